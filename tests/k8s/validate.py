#!/usr/bin/env python3
"""Offline checks of deploy/kubernetes: usage: validate.py DEPLOY_DIR FERROVOL_BINARY.

1. Every document of every manifest validates against the Kubernetes API's OpenAPI
   schemas (kubernetes-validate, strict: no unknown fields) for each version in
   K8S_VERSIONS; the snapshot API's kinds (CRDs, not in those schemas) against the
   required fields and enums of snapshot.storage.k8s.io/v1.
2. kustomization.yaml lists every manifest of the directory, and only those.
3. Every flag a manifest passes to ferrovol exists in the real binary's --help for that
   command; every sidecar flag is in the list pinned below for its image's version.
4. Sidecar images are the pinned releases (CSI spec v1.12 and older); the node plugin
   mounts every path it uses, with Bidirectional propagation for the kubelet's; every
   file or directory a ferrovol flag names lies in a mounted volume.
5. The kustomization's generated files exist; the controller's host list (csi.toml)
   parses, and if its hosts have zones, the node plugin is given one.
Prints one line per failure and exits 1 if any.
"""
import glob
import os
import re
import subprocess
import sys
import tomllib

import kubernetes_validate
import yaml

K8S_VERSIONS = ["1.31.0", "1.34.0"]

# Sidecar releases for CSI spec 1.12 (kubernetes-csi's release notes), and the flags we
# use of each.
SIDECARS = {
    "registry.k8s.io/sig-storage/csi-provisioner:v5.2.0": {
        "--csi-address", "--feature-gates", "--extra-create-metadata", "--leader-election",
        "--default-fstype", "--timeout",
    },
    "registry.k8s.io/sig-storage/csi-attacher:v4.8.1": {"--csi-address", "--leader-election", "--timeout"},
    "registry.k8s.io/sig-storage/csi-resizer:v1.13.2": {"--csi-address", "--leader-election", "--timeout"},
    "registry.k8s.io/sig-storage/csi-snapshotter:v8.2.1": {
        "--csi-address", "--leader-election", "--extra-create-metadata", "--timeout", "--feature-gates",
    },
    "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0": {
        "--csi-address", "--kubelet-registration-path",
    },
    "registry.k8s.io/sig-storage/livenessprobe:v2.15.0": {"--csi-address", "--http-endpoint"},
    # external-snapshot-metadata's first release (CSI spec 1.10's SnapshotMetadata).
    "registry.k8s.io/sig-storage/csi-snapshot-metadata:v0.1.0": {"--csi-address", "--tls-cert", "--tls-key"},
}

# Paths the node plugin and the watcher use on the host.
NODE_PATHS = {"/var/lib/kubelet", "/dev", "/sys", "/lib/modules", "/run/ferrovol/nbd", "/csi", "/etc/ferrovol/nbd-tls"}
# The watcher reconnects over TLS with the credentials at the path the attach used.
WATCH_PATHS = {"/dev", "/sys", "/run/ferrovol/nbd", "/etc/ferrovol/nbd-tls"}

failures = []


def fail(where, why):
    failures.append(f"{where}: {why}")


def check_snapshot_metadata_service(where, doc):
    """cbt.storage.k8s.io/v1alpha1 SnapshotMetadataService (a CRD of external-snapshot-metadata):
    named after the driver, with the fields the sidecar's CRD requires."""
    if doc.get("apiVersion") != "cbt.storage.k8s.io/v1alpha1" or doc.get("kind") != "SnapshotMetadataService":
        fail(where, "not a cbt.storage.k8s.io/v1alpha1 SnapshotMetadataService")
        return
    if doc.get("metadata", {}).get("name") != "csi.ferrovol.io":
        fail(where, "a SnapshotMetadataService is named after its CSI driver (csi.ferrovol.io)")
    spec = doc.get("spec", {})
    for field in ("address", "audience", "caCert"):
        if not isinstance(spec.get(field), str) or not spec[field]:
            fail(where, f"spec.{field} is missing")
    if set(spec) - {"address", "audience", "caCert"}:
        fail(where, f"unknown spec fields {sorted(set(spec) - {'address', 'audience', 'caCert'})}")


def check_group_snapshot_kind(where, doc):
    kind = doc.get("kind")
    if doc.get("apiVersion") != "groupsnapshot.storage.k8s.io/v1beta1":
        fail(where, f"{kind}: apiVersion {doc.get('apiVersion')!r}, not groupsnapshot.storage.k8s.io/v1beta1 "
                    "(external-snapshotter v8.2)")
    if not doc.get("metadata", {}).get("name"):
        fail(where, f"{kind} without metadata.name")
    if kind == "VolumeGroupSnapshotClass":
        allowed = {"apiVersion", "kind", "metadata", "driver", "deletionPolicy", "parameters"}
        for k in set(doc) - allowed:
            fail(where, f"VolumeGroupSnapshotClass: unknown field {k!r}")
        if not doc.get("driver"):
            fail(where, "VolumeGroupSnapshotClass: driver is required")
        if doc.get("deletionPolicy") not in ("Delete", "Retain"):
            fail(where, "VolumeGroupSnapshotClass: deletionPolicy must be Delete or Retain")
    elif kind == "VolumeGroupSnapshot":
        spec = doc.get("spec") or {}
        for k in set(spec) - {"source", "volumeGroupSnapshotClassName"}:
            fail(where, f"VolumeGroupSnapshot: unknown field spec.{k}")
        src = spec.get("source") or {}
        given = [k for k in ("selector", "volumeGroupSnapshotContentName") if src.get(k)]
        if len(given) != 1 or set(src) - {"selector", "volumeGroupSnapshotContentName"}:
            fail(where, "VolumeGroupSnapshot: spec.source needs exactly one of selector, "
                        "volumeGroupSnapshotContentName")
        sel = src.get("selector") or {}
        if set(sel) - {"matchLabels", "matchExpressions"}:
            fail(where, "VolumeGroupSnapshot: spec.source.selector takes matchLabels and matchExpressions")
    else:
        fail(where, f"unknown group snapshot kind {kind}")


def check_snapshot_kind(where, doc):
    kind = doc.get("kind")
    if doc.get("apiVersion") != "snapshot.storage.k8s.io/v1":
        fail(where, f"{kind}: apiVersion {doc.get('apiVersion')!r}, not snapshot.storage.k8s.io/v1")
    if not doc.get("metadata", {}).get("name"):
        fail(where, f"{kind} without metadata.name")
    if kind == "VolumeSnapshotClass":
        allowed = {"apiVersion", "kind", "metadata", "driver", "deletionPolicy", "parameters"}
        for k in set(doc) - allowed:
            fail(where, f"VolumeSnapshotClass: unknown field {k!r}")
        if not doc.get("driver"):
            fail(where, "VolumeSnapshotClass: driver is required")
        if doc.get("deletionPolicy") not in ("Delete", "Retain"):
            fail(where, "VolumeSnapshotClass: deletionPolicy must be Delete or Retain")
    elif kind == "VolumeSnapshot":
        spec = doc.get("spec") or {}
        for k in set(spec) - {"source", "volumeSnapshotClassName"}:
            fail(where, f"VolumeSnapshot: unknown field spec.{k}")
        src = spec.get("source") or {}
        given = [k for k in ("persistentVolumeClaimName", "volumeSnapshotContentName") if src.get(k)]
        if len(given) != 1 or set(src) - {"persistentVolumeClaimName", "volumeSnapshotContentName"}:
            fail(where, "VolumeSnapshot: spec.source needs exactly one of persistentVolumeClaimName, "
                        "volumeSnapshotContentName")
    else:
        fail(where, f"unknown snapshot kind {kind}")


def ferrovol_help(binary, words):
    out = subprocess.run([binary, *words, "--help"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.stdout))


def check_ferrovol_args(where, binary, args):
    # Global flags (before the subcommand) and the subcommand's words.
    globals_, words, flags = [], [], []
    for a in args:
        if a.startswith("--"):
            (flags if words else globals_).append(a.split("=", 1)[0])
        elif not flags:
            words.append(a)
    top = ferrovol_help(binary, [])
    sub = ferrovol_help(binary, words)
    if sub is None:
        fail(where, f"ferrovol {' '.join(words)} is not a command")
        return
    for g in globals_:
        if g not in (top or set()):
            fail(where, f"ferrovol has no global flag {g}")
    for f in flags:
        if f not in sub:
            fail(where, f"ferrovol {' '.join(words)} has no flag {f}")


def containers(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec, spec.get("containers", []) + spec.get("initContainers", [])


# ferrovol flags that name a file or directory of the container.
PATH_FLAGS = {
    "--config", "--tls-cert", "--tls-key", "--tls-client-ca", "--run-dir", "--data-dir", "--pool",
    "--nbd-tls-dir", "--nbd-tls-client-ca",
}


def check_paths(where, args, mounts):
    for a in args:
        flag, _, value = a.partition("=")
        if flag in PATH_FLAGS and value.startswith("/"):
            if not any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts):
                fail(where, f"{flag}={value} is in no mounted volume")


def main():
    deploy, binary = sys.argv[1], sys.argv[2]
    files = sorted(glob.glob(os.path.join(deploy, "**", "*.yaml"), recursive=True))
    kustomization = os.path.join(deploy, "kustomization.yaml")
    manifests = [f for f in files if f != kustomization]
    with open(kustomization) as k:
        listed = yaml.safe_load(k)["resources"]
    top_level = sorted(os.path.relpath(f, deploy) for f in manifests if os.path.dirname(f) == deploy.rstrip("/"))
    if sorted(listed) != top_level:
        fail("kustomization.yaml", f"resources {sorted(listed)} differ from the manifests {top_level}")
    generated = [f for g in yaml.safe_load(open(kustomization)).get("configMapGenerator", []) for f in g["files"]]
    zones = False
    for f in generated:
        full = os.path.join(deploy, f)
        if not os.path.exists(full):
            fail("kustomization.yaml", f"configMapGenerator file {f} is missing")
        elif f.endswith(".toml"):
            try:
                with open(full, "rb") as t:
                    conf = tomllib.load(t)
                zones = zones or any("zone" in h for h in conf.get("host", []))
            except tomllib.TOMLDecodeError as e:
                fail(f, f"not TOML: {e}")
    node_args = []
    checked = 0
    for path in manifests:
        with open(path) as fh:
            docs = [d for d in yaml.safe_load_all(fh) if d]
        for i, doc in enumerate(docs):
            where = f"{os.path.relpath(path, deploy)}#{i} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            checked += 1
            if doc.get("apiVersion", "").startswith("snapshot.storage.k8s.io/"):
                check_snapshot_kind(where, doc)
                continue
            if doc.get("apiVersion", "").startswith("groupsnapshot.storage.k8s.io/"):
                check_group_snapshot_kind(where, doc)
                continue
            if doc.get("apiVersion", "").startswith("cbt.storage.k8s.io/"):
                check_snapshot_metadata_service(where, doc)
                continue
            for v in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, v, strict=True)
                except kubernetes_validate.ValidationError as e:
                    fail(where, f"Kubernetes {v}: {e.message} at {'.'.join(str(p) for p in e.path)}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    fail(where, f"Kubernetes {v}: no schema ({e})")
            spec, cs = containers(doc)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in cs:
                cw = f"{where} container {c['name']}"
                image = c.get("image", "")
                if image == "ferrovol" and c.get("command"):
                    pass  # a tool of the image (an init step), not the ferrovol binary
                elif image == "ferrovol":
                    check_ferrovol_args(cw, binary, c.get("args", []))
                elif image in SIDECARS:
                    for a in c.get("args", []):
                        flag = a.split("=", 1)[0]
                        if flag not in SIDECARS[image]:
                            fail(cw, f"{flag} is not a flag pinned for {image}")
                else:
                    fail(cw, f"image {image!r} is neither ferrovol nor a pinned sidecar release")
                mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
                if image == "ferrovol":
                    check_paths(cw, c.get("args", []), mounts)
                if image == "ferrovol" and c.get("args", [])[:2] == ["csi", "node"]:
                    node_args.extend(c.get("args", []))
                for m in mounts.values():
                    if m["name"] not in volumes:
                        fail(cw, f"mounts volume {m['name']!r}, which the pod does not have")
                args = c.get("args", [])
                if image == "ferrovol" and args[:2] == ["csi", "node"]:
                    for p in NODE_PATHS - set(mounts):
                        fail(cw, f"the node plugin uses {p} but does not mount it")
                    if mounts.get("/var/lib/kubelet", {}).get("mountPropagation") != "Bidirectional":
                        fail(cw, "the kubelet directory needs mountPropagation: Bidirectional")
                    if not c.get("securityContext", {}).get("privileged"):
                        fail(cw, "the node plugin must be privileged")
                    if not spec.get("hostNetwork"):
                        fail(cw, "NBD sockets must live in the host's network namespace (hostNetwork)")
                if image == "ferrovol" and args[:2] == ["nbd", "watch"]:
                    for p in WATCH_PATHS - set(mounts):
                        fail(cw, f"the watcher uses {p} but does not mount it")
                    if not spec.get("hostNetwork"):
                        fail(cw, "the watcher's sockets must live in the host's network namespace")
    if zones and not any(a.startswith("--zone") for a in node_args):
        fail("csi.toml", "storage hosts have zones but the node plugin is given none (--zone): every claim would "
                         "fail to provision")
    for f in failures:
        print(f"FAIL {f}")
    print(f"k8s manifests: {checked} documents in {len(manifests)} files, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
