//! The uniform error body every `/api/v1` route returns.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `{"error": {"code": "...", "message": "..."}}`
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code, e.g. `not_found`, `invalid_model`.
    pub code: String,
    /// A sentence saying what went wrong and what to change.
    pub message: String,
}
