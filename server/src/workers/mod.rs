//! Workers as people see them: hosts with their devices, online or offline.

pub mod agent;

use axum::extract::State;
use sqlx::any::AnyRow;
use sqlx::Row;
use std::collections::HashMap;

use tessera_api::mig::SliceStatus;
use tessera_api::workers::{Worker, WorkerStatus};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::Principal;
use crate::store::db::{self, now_ms};
use crate::error::{ApiJson, Result};

/// Misses this many heartbeats and a worker is shown offline.
const MISSED_BEATS_OFFLINE: i64 = 3;

fn worker_from_row(row: &AnyRow, online_since: i64, slices: &mut HashMap<Uuid, Vec<SliceStatus>>) -> Result<Worker> {
    let id: String = row.try_get("id")?;
    let inventory: String = row.try_get("inventory")?;
    let last_seen: i64 = row.try_get("last_seen_at")?;
    let id: Uuid = id.parse().map_err(|e| anyhow::anyhow!("bad worker id {id}: {e}"))?;
    Ok(Worker {
        id,
        name: row.try_get("name")?,
        version: row.try_get("version")?,
        status: if last_seen >= online_since { WorkerStatus::Online } else { WorkerStatus::Offline },
        inventory: serde_json::from_str(&inventory).map_err(|e| anyhow::anyhow!("stored inventory unreadable: {e}"))?,
        slices: slices.remove(&id).unwrap_or_default(),
        allow_repartition: row.try_get::<i64, _>("allow_repartition")? != 0,
        registered_at: db::time(row.try_get("registered_at")?),
        last_seen_at: db::time(last_seen),
    })
}

/// The earliest last-seen time that still counts as online.
pub fn online_since(state: &AppState) -> i64 {
    now_ms() - MISSED_BEATS_OFFLINE * state.config.heartbeat_secs as i64 * 1000
}

pub async fn list_all(state: &AppState) -> Result<Vec<Worker>> {
    let rows = sqlx::query(
        "SELECT id, name, version, inventory, allow_repartition, registered_at, last_seen_at FROM workers ORDER BY name",
    )
    .fetch_all(state.db.pool())
    .await?;
    let since = online_since(state);
    let mut slices = crate::fleet::slices::by_worker(&state.db).await?;
    rows.iter().map(|row| worker_from_row(row, since, &mut slices)).collect()
}

pub async fn count_online(state: &AppState) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE last_seen_at >= $1")
        .bind(online_since(state))
        .fetch_one(state.db.pool())
        .await?)
}

/// List workers with their devices and when each was last seen. Workers are shared
/// infrastructure, so every signed-in user sees all of them.
#[utoipa::path(get, path = "/api/v1/workers", tag = "workers", security(("bearer" = [])),
    responses((status = 200, body = Vec<Worker>)))]
pub async fn list(State(state): State<AppState>, _principal: Principal) -> Result<ApiJson<Vec<Worker>>> {
    Ok(ApiJson(list_all(&state).await?))
}
