//! `Idempotent-Replayed: true` for handlers made idempotent with the attribute.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderValue, Response};
use tower_layer::Layer;
use tower_service::Service;

use crate::protocol::track_replays;

/// Adds `Idempotent-Replayed: true` to a response when the handler's
/// `#[idempotent]` call replayed a stored result instead of running its body.
///
/// [`IdempotencyLayer`](super::IdempotencyLayer) marks its own replays; this
/// layer is for the attribute path (business keys, no header), where only the
/// protocol knows. It uses [`track_replays`]: only a top-level idempotent call
/// made while handling the request counts.
///
/// ```
/// use axum::{Router, routing::post};
/// use idem_runtime::http::ReplayedHeaderLayer;
///
/// # async fn handler() {}
/// let app: Router = Router::new().route("/pay", post(handler)).layer(ReplayedHeaderLayer);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayedHeaderLayer;

impl<S> Layer<S> for ReplayedHeaderLayer {
    type Service = ReplayedHeaderService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReplayedHeaderService { inner }
    }
}

/// The service of [`ReplayedHeaderLayer`].
#[derive(Debug, Clone)]
pub struct ReplayedHeaderService<S> {
    inner: S,
}

impl<S, Req, B> Service<Req> for ReplayedHeaderService<S>
where
    S: Service<Req, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = Response<B>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let fut = self.inner.call(req);
        Box::pin(async move {
            let (out, replayed) = track_replays(fut).await;
            let mut res = out?;
            if replayed {
                res.headers_mut().insert(
                    super::IDEMPOTENT_REPLAYED_NAME,
                    HeaderValue::from_static("true"),
                );
            }
            Ok(res)
        })
    }
}
