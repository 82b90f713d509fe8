//! The OpenAPI document (generated from the handlers' annotations) and the security
//! schemes it names.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "Tessera API", description = "Self-hosted transformer inference and training platform."),
    modifiers(&SecuritySchemes),
    tags(
        (name = "accounts", description = "Logins and users"),
        (name = "tokens", description = "Personal API tokens"),
        (name = "models", description = "The model registry"),
        (name = "datasets", description = "Training data: CSV or JSONL, checked and content-addressed"),
        (name = "jobs", description = "The job queue, training jobs with their metrics, AutoLRS stages, checkpoints and precision plans"),
        (name = "deployments", description = "Models served under a name, with replicas"),
        (name = "workers", description = "Worker hosts and their devices"),
        (name = "agent", description = "The protocol workers speak (worker secrets only)"),
    )
)]
pub struct ApiDoc;

struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(description)).build())
        };
        components.add_security_scheme("bearer", bearer("A session JWT from /api/v1/auth/login or a personal API token."));
        components.add_security_scheme("worker_token", bearer("The shared TESSERA_WORKER_TOKEN."));
        components.add_security_scheme("worker", bearer("The secret a worker got when it registered."));
    }
}
