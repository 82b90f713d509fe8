//! A submitted training job, checked against the dataset and model it names and
//! resolved into the `TrainJob` a worker receives. The body was parsed once, into
//! `TrainSpec`, by `jobs`; this adds the checks that need the database.

use serde_json::Value;
use tessera_api::datasets::{ColumnType, Dataset, DatasetColumn};
use tessera_api::train::{
    self, BuiltinModel, ModelChoice, SpecError, TaskType, TrainDataset, TrainJob, TrainModel, TrainSpec, TrainTask,
    MAX_CLASSES, MAX_TEXT_TOKENS,
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

/// Refuses a column the job reads when some of its rows have no value: the worker would
/// fail on the first of them, after the job had waited its turn. A dataset uploaded before
/// missing values were counted records none here; a job on it fails on the worker instead,
/// naming the column and the row.
fn complete(column: &DatasetColumn, field: &str, rows: u64) -> Result<()> {
    if column.missing == 0 {
        return Ok(());
    }
    Err(field_error(
        field,
        format!(
            "{:?} has no value in {} of the dataset's {rows} rows; a job reads only columns with a value in \
             every row, so fill them in or leave the column out",
            column.name, column.missing
        ),
    ))
}

/// The classes of a classification label, as far as the dataset's counts know them (2, the
/// fewest a job trains on, where they were not counted: the worker checks its data).
fn classes(label: &DatasetColumn) -> Result<u64> {
    match label.distinct {
        Some(count) if count > MAX_CLASSES as u64 => Err(field_error(
            "task.label_column",
            format!(
                "{:?} holds more than {MAX_CLASSES} distinct values, the most classes a job may have; train a \
                 regression on it, or pick the column that holds the classes",
                label.name
            ),
        )),
        Some(count) => Ok(count.max(2)),
        None => Ok(2),
    }
}

/// What one row's forward holds in the encoder a registered model's stored config
/// describes, at the longest input the worker tokenises; `None` when the config lacks a
/// size (the worker checks with the `config.json` it loads).
fn encoder_activations(config: &Value) -> Option<u64> {
    let size = |key: &str| config.get(key).and_then(Value::as_u64);
    let hidden = size("hidden_size")?;
    let tokens = size("max_position_embeddings")?.min(MAX_TEXT_TOKENS as u64);
    // Models registered before the registry kept it: BERT-family models use four times the width.
    let intermediate = size("intermediate_size").unwrap_or(hidden.saturating_mul(4));
    let (heads, layers) = (size("num_attention_heads")?, size("num_hidden_layers")?);
    Some(train::encoder_activations_per_row(tokens, hidden, intermediate, heads, layers))
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
    // A step trains on a batch of at most the training rows (the worker clamps it).
    let batch = u64::from(spec.batch_size).min(trained);
    let label = column(&dataset, &task.label_column, "task.label_column")?;
    if task.kind == TaskType::Regression && label.kind != ColumnType::Number {
        return Err(field_error(
            "task.label_column",
            format!("regression needs a number column; {:?} holds strings", label.name),
        ));
    }
    complete(label, "task.label_column", dataset.rows)?;
    let outputs = match task.kind {
        TaskType::Classification => classes(label)?,
        TaskType::Regression => 1,
    };
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
                        complete(found, &field, dataset.rows)?;
                    }
                    names.clone()
                }
                None => {
                    let chosen: Vec<&DatasetColumn> = dataset
                        .columns
                        .iter()
                        .filter(|c| c.kind == ColumnType::Number && c.name != task.label_column)
                        .collect();
                    for found in &chosen {
                        complete(found, "task.feature_columns", dataset.rows)?;
                    }
                    chosen.iter().map(|c| c.name.clone()).collect()
                }
            };
            if features.is_empty() {
                return Err(field_error(
                    "task.feature_columns",
                    "the MLP needs at least one number column besides the label",
                ));
            }
            let widths: Vec<u64> = std::iter::once(features.len() as u64)
                .chain(hidden.iter().map(|&width| u64::from(width)))
                .chain([outputs])
                .collect();
            train::check_mlp(&widths, batch).map_err(spec_error)?;
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
            let text_column = column(&dataset, text, "task.text_column")?;
            if text_column.kind != ColumnType::String {
                return Err(field_error("task.text_column", format!("{text:?} holds numbers, not text")));
            }
            if text == task.label_column {
                return Err(field_error("task.text_column", "the text column cannot be the label"));
            }
            complete(text_column, "task.text_column", dataset.rows)?;
            // The encoder's size is the registered model's; the batch is the spec's.
            let config = models::config(&state.db, model.id).await?;
            if let Some(per_row) = config.as_ref().and_then(encoder_activations) {
                train::check_activations(batch, per_row).map_err(spec_error)?;
            }
            let num_labels =
                config.as_ref().and_then(|c| c.get("num_labels").and_then(Value::as_u64)).map(|n| n as u32);
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
