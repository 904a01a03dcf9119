//! Checking each sample against the schema that the first sample set: payload size, metadata
//! keys and types, and the placing of a sample's values in schema order.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::*;
use crate::metadata::{Field, FieldType, MetaValue, MetadataWriter, SAMPLE_ID};

use super::{CacheWriter, MetaKey};

/// The schema positions of the keys of the last sample that was matched by name, remembered by
/// the keys' identities in that sample's order.
#[derive(Default)]
pub(super) struct KeySlots {
    ids: Vec<usize>,
    slots: Vec<usize>,
}

impl KeySlots {
    /// The schema positions of `keys` when they are the remembered identities, in order.
    pub(super) fn lookup(&self, keys: &[MetaKey<'_>]) -> Option<&[usize]> {
        let same =
            keys.len() == self.ids.len() && keys.iter().zip(&self.ids).all(|(k, id)| k.id == *id);
        same.then_some(self.slots.as_slice())
    }

    pub(super) fn remember(&mut self, keys: &[MetaKey<'_>], slots: Vec<usize>) {
        self.ids.clear();
        self.ids.extend(keys.iter().map(|k| k.id));
        self.slots = slots;
    }
}

/// `values[i]` moved to position `slots[i]`; `slots` is a permutation of the positions.
pub(super) fn place(values: Vec<MetaValue>, slots: &[usize]) -> Vec<MetaValue> {
    if slots.iter().enumerate().all(|(i, &slot)| i == slot) {
        return values;
    }
    let mut placed: Vec<Option<MetaValue>> = vec![None; values.len()];
    for (value, &slot) in values.into_iter().zip(slots) {
        placed[slot] = Some(value);
    }
    placed
        .into_iter()
        .map(|v| v.expect("the slots are a permutation"))
        .collect()
}

fn describe_schema(fields: &[Field]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .map(|f| format!("{}: {}", f.name, f.dtype.as_str()))
        .collect();
    format!("{{{}}}", parts.join(", "))
}

impl CacheWriter {
    pub(super) fn invalid(&self, reason: impl Into<String>) -> Error {
        Error::InvalidSample {
            source_name: self.lock.name.clone(),
            sample_index: self.pushed,
            reason: reason.into(),
        }
    }

    pub(super) fn check_payload(&self, data: &[u8]) -> Result<()> {
        if data.len() > u32::MAX as usize {
            return Err(self.invalid(format!(
                "payload of {} bytes exceeds the format's 4 GiB record limit",
                data.len()
            )));
        }
        Ok(())
    }

    pub(super) fn init_schema<'a>(
        &mut self,
        first: impl Iterator<Item = (&'a str, FieldType)>,
    ) -> Result<()> {
        let fields: Vec<Field> = first
            .map(|(name, dtype)| Field {
                name: name.to_owned(),
                dtype,
            })
            .collect();
        // A cache whose metadata could never become its samples-metadata table is refused now,
        // not at the table's first use.
        for f in &fields {
            if f.name == crate::samples::CACHE_ID || f.name == crate::samples::WEIGHT {
                return Err(self.invalid(format!(
                    "metadata key {:?} is a column of the samples-metadata table (cache_id | \
                     sample_id | <metadata> | weight); rename the key",
                    f.name
                )));
            }
            if f.name.is_empty() {
                return Err(
                    self.invalid("metadata key \"\" is empty: a column needs a name".to_owned())
                );
            }
            if f.name.contains('\0') {
                return Err(self.invalid(format!(
                    "metadata key {:?} holds a NUL byte, which a column name cannot hold",
                    f.name
                )));
            }
        }
        if let Some(f) = fields.iter().find(|f| f.name == SAMPLE_ID) {
            if !matches!(f.dtype, FieldType::Int | FieldType::Str) {
                return Err(self.invalid(format!(
                    "metadata \"sample_id\" must be an int or a str, got {}",
                    f.dtype.as_str()
                )));
            }
            self.id_source = SampleIdSource::Metadata;
            self.id_type = f.dtype;
        }
        let meta_path = self.tmp_dir.join(METADATA_FILE);
        let writer = MetadataWriter::create(&meta_path, &fields, self.id_type)?;
        self.shared.sink.lock().unwrap().metadata = Some(writer);
        self.id_slot = fields.iter().position(|f| f.name == SAMPLE_ID);
        self.fields = Some(Arc::new(fields));
        Ok(())
    }

    /// The values in schema order, and the schema position of each given key; the first key
    /// that is not in the schema, has another type or is missing is the error.
    pub(super) fn ordered_values<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        given: Vec<MetaValue>,
    ) -> Result<(Vec<MetaValue>, Vec<usize>)> {
        let fields = self
            .fields
            .as_deref()
            .expect("schema set before any sample");
        let mut values: Vec<Option<MetaValue>> = vec![None; fields.len()];
        let mut slots = Vec::with_capacity(given.len());
        for (name, value) in names.zip(given) {
            let Some(i) = fields.iter().position(|f| f.name == name) else {
                return Err(self.invalid(format!(
                    "metadata key {name:?} is not in the schema set by sample 0 ({})",
                    describe_schema(fields)
                )));
            };
            if value.dtype() != fields[i].dtype {
                return Err(self.invalid(format!(
                    "metadata {name:?} is {}, but sample 0 made it {}",
                    value.dtype().as_str(),
                    fields[i].dtype.as_str()
                )));
            }
            values[i] = Some(value);
            slots.push(i);
        }
        let values = values
            .into_iter()
            .zip(fields)
            .map(|(v, f)| {
                v.ok_or_else(|| {
                    self.invalid(format!(
                        "metadata key {:?} is missing; the schema set by sample 0 is {}",
                        f.name,
                        describe_schema(fields)
                    ))
                })
            })
            .collect::<Result<_>>()?;
        Ok((values, slots))
    }
}
