//! A submitted training job, checked against the dataset and model it names and
//! resolved into the `TrainJob` a worker receives. The body was parsed once, into
//! `TrainSpec`, by `jobs`; this adds the checks that need the database.

use serde_json::Value;
use tessera_api::datasets::{ColumnType, Dataset, DatasetColumn};
use tessera_api::train::{
    BuiltinModel, ModelChoice, SpecError, TaskType, TrainDataset, TrainJob, TrainModel, TrainSpec, TrainTask,
};
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::store::models;
use crate::{datasets, registry};

fn spec_error(error: SpecError) -> Error {
    Error::invalid("invalid_spec", error.to_string())
}

fn field_error(field: &str, message: impl Into<String>) -> Error {
    spec_error(SpecError::new(field, message))
}

fn column<'a>(dataset: &'a Dataset, name: &str, field: &str) -> Result<&'a DatasetColumn> {
    dataset.columns.iter().find(|c| c.name == name).ok_or_else(|| {
        let names: Vec<&str> = dataset.columns.iter().map(|c| c.name.as_str()).collect();
        field_error(field, format!("the dataset has no column {name:?}; its columns are {}", names.join(", ")))
    })
}

/// Checks the spec against its dataset and model and spells out what the worker needs.
/// Returns the resolved job and the dataset's id.
pub async fn resolve(state: &AppState, principal: &Principal, spec: &TrainSpec) -> Result<(TrainJob, Uuid)> {
    spec.validate().map_err(spec_error)?;
    let dataset = match datasets::resolve(state, principal, spec.dataset.trim()).await {
        Ok(dataset) => dataset,
        Err(Error::NotFound(_)) => {
            return Err(field_error("dataset", format!("no dataset {:?} among yours; upload it first", spec.dataset)))
        }
        Err(other) => return Err(other),
    };
    let task = &spec.task;
    // As the worker splits the rows: the validation rows rounded.
    let held_out = (dataset.rows as f64 * task.validation_split).round() as u64;
    if held_out == 0 || held_out >= dataset.rows {
        return Err(field_error(
            "task.validation_split",
            format!("leaves no validation or no training rows of the dataset's {}", dataset.rows),
        ));
    }
    // Each rank computes its share of every batch, and a batch holds at most the training rows.
    let (trained, ranks) = (dataset.rows - held_out, spec.parallel.as_ref().map_or(1, |p| p.ranks.len() as u64));
    if trained < ranks {
        return Err(field_error(
            "parallel.ranks",
            format!(
                "{ranks} ranks need a training row each, and the dataset's {} rows leave {trained} after the \
                 validation split; use fewer ranks or a smaller validation_split",
                dataset.rows
            ),
        ));
    }
    let label = column(&dataset, &task.label_column, "task.label_column")?;
    if task.kind == TaskType::Regression && label.kind != ColumnType::Number {
        return Err(field_error(
            "task.label_column",
            format!("regression needs a number column; {:?} holds strings", label.name),
        ));
    }
    let (model, feature_columns, text_column) = match &spec.model {
        ModelChoice::Builtin(BuiltinModel::Mlp { hidden }) => {
            if task.text_column.is_some() {
                return Err(field_error("task.text_column", "an MLP reads numeric feature_columns, not text"));
            }
            let features = match &task.feature_columns {
                Some(names) => {
                    for (i, name) in names.iter().enumerate() {
                        let field = format!("task.feature_columns[{i}]");
                        let found = column(&dataset, name, &field)?;
                        if found.kind != ColumnType::Number {
                            return Err(field_error(
                                &field,
                                format!("{name:?} holds strings; an MLP needs number columns"),
                            ));
                        }
                        if *name == task.label_column || names[..i].contains(name) {
                            return Err(field_error(&field, format!("{name:?} is the label or listed twice")));
                        }
                    }
                    names.clone()
                }
                None => dataset
                    .columns
                    .iter()
                    .filter(|c| c.kind == ColumnType::Number && c.name != task.label_column)
                    .map(|c| c.name.clone())
                    .collect(),
            };
            if features.is_empty() {
                return Err(field_error(
                    "task.feature_columns",
                    "the MLP needs at least one number column besides the label",
                ));
            }
            (TrainModel::Mlp { hidden: hidden.clone() }, features, None)
        }
        ModelChoice::Registered(id_or_name) => {
            let model = match registry::resolve(state, principal, id_or_name).await {
                Ok(model) => model,
                Err(Error::NotFound(_)) => {
                    return Err(field_error("model", format!("no model {id_or_name:?} among yours; upload it first")))
                }
                Err(other) => return Err(other),
            };
            if task.feature_columns.is_some() {
                return Err(field_error(
                    "task.feature_columns",
                    "a transformer model reads text_column, not feature columns",
                ));
            }
            let text = task
                .text_column
                .as_deref()
                .ok_or_else(|| field_error("task.text_column", "name the column holding the text to fine-tune on"))?;
            if column(&dataset, text, "task.text_column")?.kind != ColumnType::String {
                return Err(field_error("task.text_column", format!("{text:?} holds numbers, not text")));
            }
            if text == task.label_column {
                return Err(field_error("task.text_column", "the text column cannot be the label"));
            }
            let num_labels = models::config(&state.db, model.id)
                .await?
                .and_then(|c| c.get("num_labels").and_then(Value::as_u64))
                .map(|n| n as u32);
            let model =
                TrainModel::Registered { id: model.id, name: model.name, architecture: model.architecture, num_labels };
            (model, Vec::new(), Some(text.to_string()))
        }
    };
    let job = TrainJob {
        model,
        dataset: TrainDataset {
            id: dataset.id,
            digest: dataset.digest.clone(),
            format: dataset.format,
            // The columns the job reads, not all of them: a rank's spec carries them too.
            columns: dataset
                .columns
                .iter()
                .filter(|c| {
                    c.name == task.label_column
                        || feature_columns.contains(&c.name)
                        || text_column.as_ref() == Some(&c.name)
                })
                .cloned()
                .collect(),
            rows: dataset.rows,
        },
        task: TrainTask {
            kind: task.kind,
            label_column: task.label_column.clone(),
            feature_columns,
            text_column,
            validation_split: task.validation_split,
        },
        optimizer: spec.optimizer.clone(),
        batch_size: spec.batch_size,
        max_steps: spec.max_steps,
        eval_every: spec.eval_every,
        checkpoint_every: spec.checkpoint_every,
        lr_schedule: spec.lr_schedule.clone(),
        seed: spec.seed,
        parallel: spec.parallel.clone(),
        resources: Some(spec.resolve_resources().map_err(spec_error)?),
    };
    Ok((job, dataset.id))
}
