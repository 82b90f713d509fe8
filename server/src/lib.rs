//! tessera-server: the control plane. REST API and dashboard, model registry, job queue
//! with leases, worker protocol, all backed by SQLite or PostgreSQL.

pub mod accounts;
pub mod app;
pub mod auth;
pub mod config;
pub mod datasets;
pub mod deployments;
pub mod error;
pub mod fleet;
pub mod gangs;
pub mod gateway;
pub mod jobs;
pub mod loaning;
pub mod multipart;
pub mod openapi;
pub mod paging;
pub mod quotas;
pub mod registry;
pub mod scheduler;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod training;
pub mod web;
pub mod workers;
