//! A graceful stop for a gRPC server that cannot hang: once told to stop, a tonic
//! server finishes its calls in flight and waits for each connection to close
//! (HTTP/2 GOAWAY, then a PING the client must answer). A client that never answers
//! (stopped, partitioned, its runtime blocked) would hold that stop forever; here it
//! holds it for at most a limit. Used by the storage host's management API and by the
//! CSI plugins. Not here: what a server serves, or the signals that stop it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How long a server told to stop waits for its connections to close: long enough
/// for a management call in flight (a snapshot, a resize) to finish, well inside
/// Kubernetes' default termination grace period (30 s).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// How a server's stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every connection closed within the limit.
    Drained,
    /// The limit ran out with connections still open; they were dropped.
    LimitReached,
}

/// The shutdown future handed to the server (boxed: tonic takes any `Future<Output = ()>`).
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs `serve(shutdown)` until it returns, where `shutdown` resolves when `stop`
/// does; from then on the server has `limit` to finish, after which it is dropped
/// (its connections closed) and [`Stopped::LimitReached`] is returned.
///
/// Errors: the server's own error (a listener that failed), as it returned it.
pub async fn serve_with_drain_limit<S, F, E>(
    stop: S,
    limit: Duration,
    serve: impl FnOnce(Shutdown) -> F,
) -> Result<Stopped, E>
where
    S: Future<Output = ()> + Send + 'static,
    F: Future<Output = Result<(), E>>,
{
    let told = Arc::new(tokio::sync::Notify::new());
    let tell = Arc::clone(&told);
    let serving = serve(Box::pin(async move {
        stop.await;
        // notify_one keeps a permit if the waiter below is not waiting yet.
        tell.notify_one();
    }));
    tokio::pin!(serving);
    tokio::select! {
        served = &mut serving => served.map(|()| Stopped::Drained),
        () = async { told.notified().await; tokio::time::sleep(limit).await } => Ok(Stopped::LimitReached),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that never finishes its drain is stopped at the limit; one that does
    /// reports its own result.
    #[tokio::test(start_paused = true)]
    async fn the_limit_ends_a_drain_that_never_ends() {
        let hung = serve_with_drain_limit(async {}, Duration::from_secs(3), |shutdown| async move {
            shutdown.await;
            std::future::pending::<Result<(), ()>>().await
        });
        let t0 = tokio::time::Instant::now();
        assert_eq!(hung.await, Ok(Stopped::LimitReached));
        assert_eq!(t0.elapsed(), Duration::from_secs(3));
        let clean = serve_with_drain_limit(async {}, Duration::from_secs(3), |shutdown| async move {
            shutdown.await;
            Ok::<_, ()>(())
        });
        assert_eq!(clean.await, Ok(Stopped::Drained));
        let failed = serve_with_drain_limit(std::future::pending(), Duration::from_secs(3), |_| async { Err("bind") });
        assert_eq!(failed.await, Err("bind"));
    }
}
