//! The samples-metadata table: `cache_id | sample_id | <metadata...> | weight`, exported as Arrow
//! IPC for Polars, and the validation of an edited table before its weights take effect.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type};
use arrow_array::{new_null_array, Array, ArrayRef, Float64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field as ArrowField, Schema, SchemaRef};

use crate::cache::Cache;
use crate::dataset::{Dataset, WeightTable};
use crate::error::{Error, Result};
use crate::metadata::{FieldType, MetaRef, MetadataTable, SAMPLE_ID};

pub const CACHE_ID: &str = "cache_id";
pub const WEIGHT: &str = "weight";
/// Offending rows quoted in one error message.
const MAX_QUOTED: usize = 5;

fn arrow_type(t: FieldType) -> DataType {
    match t {
        FieldType::Bool => DataType::Boolean,
        FieldType::Int => DataType::Int64,
        FieldType::Float => DataType::Float64,
        FieldType::Str => DataType::Utf8,
    }
}

/// The table's columns: identity, the union of metadata columns in first-appearance order
/// (a cache without one has nulls there), and the weight.
pub struct TableLayout {
    pub schema: SchemaRef,
    pub id_type: FieldType,
    /// (name, type) of each metadata column, and per cache its column in `metadata.arrow`.
    pub columns: Vec<(String, FieldType, Vec<Option<usize>>)>,
}

/// The metadata tables of the dataset's caches, in order: the first use of a cache's table
/// checks and decodes its `metadata.arrow`, so a damaged one is reported here.
fn tables(ds: &Dataset) -> Result<Vec<&MetadataTable>> {
    ds.caches.iter().map(|c| c.metadata()).collect()
}

/// Why `caches` cannot share one metadata table: the first column (other than the sample id,
/// which may be int in one and str in another) whose type differs between two of them. A
/// column one cache lacks is null in its rows; a column of two types cannot be.
pub fn column_type_conflict<'a>(caches: impl IntoIterator<Item = &'a Cache>) -> Option<String> {
    let mut seen: HashMap<&str, FieldType> = HashMap::new();
    for cache in caches {
        let schema = &cache.manifest.metadata_schema;
        for f in schema.iter().filter(|f| f.name != SAMPLE_ID) {
            match seen.get(f.name.as_str()) {
                Some(t) if *t != f.dtype => {
                    return Some(format!(
                        "metadata column {:?} is {} in cache {:?} but {} in an earlier cache",
                        f.name,
                        f.dtype.as_str(),
                        cache.name(),
                        t.as_str()
                    ))
                }
                Some(_) => {}
                None => {
                    seen.insert(&f.name, f.dtype);
                }
            }
        }
    }
    None
}

pub fn layout(ds: &Dataset) -> Result<TableLayout> {
    if let Some(why) = column_type_conflict(ds.caches.iter().map(|c| c.as_ref())) {
        return Err(Error::SamplesMetadata(why));
    }
    let tables = tables(ds)?;
    let id_types: Vec<FieldType> = ds
        .caches
        .iter()
        .map(|c| c.manifest.sample_id_type)
        .collect();
    // Caches with int and str ids side by side share a str column (ints in decimal).
    let id_type = if id_types.iter().all(|t| *t == FieldType::Int) {
        FieldType::Int
    } else {
        FieldType::Str
    };
    let mut columns: Vec<(String, FieldType, Vec<Option<usize>>)> = Vec::new();
    for (ci, cache) in ds.caches.iter().enumerate() {
        for f in cache
            .manifest
            .metadata_schema
            .iter()
            .filter(|f| f.name != SAMPLE_ID)
        {
            if f.name == CACHE_ID || f.name == WEIGHT {
                return Err(Error::SamplesMetadata(format!(
                    "cache {:?} has a metadata column named {:?}, which the table reserves",
                    cache.name(),
                    f.name
                )));
            }
            let col = tables[ci]
                .schema
                .index_of(&f.name)
                .expect("checked on load");
            // One type per column across the caches: checked above.
            match columns.iter_mut().find(|(n, _, _)| *n == f.name) {
                Some((_, _, per_cache)) => per_cache[ci] = Some(col),
                None => {
                    let mut per_cache = vec![None; ds.caches.len()];
                    per_cache[ci] = Some(col);
                    columns.push((f.name.clone(), f.dtype, per_cache));
                }
            }
        }
    }
    let mut fields = vec![
        ArrowField::new(CACHE_ID, DataType::Utf8, false),
        ArrowField::new(SAMPLE_ID, arrow_type(id_type), false),
    ];
    fields.extend(
        columns
            .iter()
            .map(|(n, t, _)| ArrowField::new(n, arrow_type(*t), true)),
    );
    fields.push(ArrowField::new(WEIGHT, DataType::Float64, false));
    Ok(TableLayout {
        schema: Arc::new(Schema::new(fields)),
        id_type,
        columns,
    })
}

fn ipc_err(e: impl std::fmt::Display) -> Error {
    Error::SamplesMetadata(format!("Arrow IPC: {e}"))
}

/// The table as record batches sharing the caches' metadata columns (no copy of them): one
/// batch per metadata batch of each cache. Polars imports them through the Arrow C stream.
pub fn table(ds: &Dataset, weights: &WeightTable) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let layout = layout(ds)?;
    let tables = tables(ds)?;
    let mut out = Vec::new();
    for (ci, cache) in ds.caches.iter().enumerate() {
        let mut row0 = ds.cache_start(ci) as usize;
        // One cache_id column of the longest batch, sliced for each batch.
        let longest = tables[ci]
            .batches
            .iter()
            .map(|b| b.num_rows())
            .max()
            .unwrap_or(0);
        let cache_ids = StringArray::from_iter_values(std::iter::repeat_n(cache.name(), longest));
        for batch in &tables[ci].batches {
            let n = batch.num_rows();
            let mut cols: Vec<ArrayRef> = Vec::with_capacity(layout.schema.fields().len());
            cols.push(Arc::new(cache_ids.slice(0, n)));
            let ids = batch.column(0);
            if cache.manifest.sample_id_type == layout.id_type {
                cols.push(ids.clone());
            } else {
                let ints = ids.as_primitive::<Int64Type>();
                cols.push(Arc::new(StringArray::from_iter_values(
                    ints.values().iter().map(|v| v.to_string()),
                )));
            }
            for (_, t, per_cache) in &layout.columns {
                cols.push(match per_cache[ci] {
                    Some(c) => batch.column(c).clone(),
                    None => new_null_array(&arrow_type(*t), n),
                });
            }
            let w = match &weights.weights {
                Some(w) => Float64Array::from(w[row0..row0 + n].to_vec()),
                None => Float64Array::from(vec![1.0; n]),
            };
            cols.push(Arc::new(w));
            out.push(RecordBatch::try_new(layout.schema.clone(), cols).map_err(ipc_err)?);
            row0 += n;
        }
    }
    Ok((layout.schema, out))
}

/// The rows of the table for the samples `globals` (global indices, in that order, repeats
/// allowed), as one record batch with the table's schema. The metadata columns are gathered
/// from the caches' record batches by Arrow's `interleave`, without going through values one by
/// one; `weights` are the weights the rows report.
pub fn rows(ds: &Dataset, weights: &WeightTable, globals: &[u64]) -> Result<RecordBatch> {
    let layout = layout(ds)?;
    let tables = tables(ds)?;
    // Every metadata batch of every cache is one source; one null row follows them, for the
    // columns a cache lacks.
    let mut first_source = Vec::with_capacity(ds.caches.len());
    let mut sources = 0usize;
    for table in &tables {
        first_source.push(sources);
        sources += table.batches.len();
    }
    let null_source = sources;
    let located: Vec<(usize, usize, usize)> = globals
        .iter()
        .map(|&g| {
            let (c, row) = ds.locate(g);
            let (b, r) = tables[c].locate(row);
            (c, first_source[c] + b, r)
        })
        .collect();
    let gather = |column_of: &dyn Fn(usize) -> Option<usize>, t: &DataType| -> Result<ArrayRef> {
        let null = new_null_array(t, 1);
        let mut arrays: Vec<&dyn Array> = Vec::with_capacity(sources + 1);
        for (ci, table) in tables.iter().enumerate() {
            for batch in &table.batches {
                arrays.push(match column_of(ci) {
                    Some(col) => batch.column(col).as_ref(),
                    None => null.as_ref(),
                });
            }
        }
        arrays.push(null.as_ref());
        let indices: Vec<(usize, usize)> = located
            .iter()
            .map(|&(c, src, r)| match column_of(c) {
                Some(_) => (src, r),
                None => (null_source, 0),
            })
            .collect();
        arrow_select::interleave::interleave(&arrays, &indices).map_err(ipc_err)
    };
    let mut cols: Vec<ArrayRef> = Vec::with_capacity(layout.schema.fields().len());
    cols.push(Arc::new(StringArray::from_iter_values(
        located.iter().map(|&(c, _, _)| ds.caches[c].name()),
    )));
    let same_id_type = ds
        .caches
        .iter()
        .all(|c| c.manifest.sample_id_type == layout.id_type);
    if same_id_type {
        cols.push(gather(&|_| Some(0), &arrow_type(layout.id_type))?);
    } else {
        // Int ids beside str ids are shown in decimal, as `table` does.
        cols.push(Arc::new(StringArray::from_iter_values(globals.iter().map(
            |&g| {
                let (c, row) = ds.locate(g);
                match tables[c].sample_id(row) {
                    MetaRef::Str(s) => s.to_owned(),
                    other => show(Some(other)),
                }
            },
        ))));
    }
    for (_, t, per_cache) in &layout.columns {
        cols.push(gather(&|c| per_cache[c], &arrow_type(*t))?);
    }
    cols.push(Arc::new(Float64Array::from_iter_values(
        globals.iter().map(|&g| weights.weight(g)),
    )));
    RecordBatch::try_new(layout.schema, cols).map_err(ipc_err)
}

/// A column of the submitted table, read as typed values whatever Arrow encoding Polars chose.
enum Col<'a> {
    Bool(&'a arrow_array::BooleanArray),
    Int(&'a arrow_array::Int64Array),
    F64(&'a arrow_array::Float64Array),
    F32(&'a arrow_array::Float32Array),
    Utf8(&'a arrow_array::StringArray),
    LargeUtf8(&'a arrow_array::LargeStringArray),
    View(&'a arrow_array::StringViewArray),
    Null,
}

impl<'a> Col<'a> {
    fn new(a: &'a ArrayRef) -> Option<Col<'a>> {
        Some(match a.data_type() {
            DataType::Boolean => Col::Bool(a.as_boolean()),
            DataType::Int64 => Col::Int(a.as_primitive::<Int64Type>()),
            DataType::Float64 => Col::F64(a.as_primitive::<Float64Type>()),
            DataType::Float32 => Col::F32(a.as_primitive::<Float32Type>()),
            DataType::Utf8 => Col::Utf8(a.as_string::<i32>()),
            DataType::LargeUtf8 => Col::LargeUtf8(a.as_string::<i64>()),
            DataType::Utf8View => Col::View(a.as_string_view()),
            DataType::Null => Col::Null,
            _ => return None,
        })
    }

    fn get(&self, i: usize) -> Option<MetaRef<'a>> {
        let null = match self {
            Col::Null => true,
            Col::Bool(a) => a.is_null(i),
            Col::Int(a) => a.is_null(i),
            Col::F64(a) => a.is_null(i),
            Col::F32(a) => a.is_null(i),
            Col::Utf8(a) => a.is_null(i),
            Col::LargeUtf8(a) => a.is_null(i),
            Col::View(a) => a.is_null(i),
        };
        if null {
            return None;
        }
        Some(match self {
            Col::Bool(a) => MetaRef::Bool(a.value(i)),
            Col::Int(a) => MetaRef::Int(a.value(i)),
            Col::F64(a) => MetaRef::Float(a.value(i)),
            Col::F32(a) => MetaRef::Float(f64::from(a.value(i))),
            Col::Utf8(a) => MetaRef::Str(a.value(i)),
            Col::LargeUtf8(a) => MetaRef::Str(a.value(i)),
            Col::View(a) => MetaRef::Str(a.value(i)),
            Col::Null => unreachable!(),
        })
    }
}

fn same(a: Option<MetaRef<'_>>, b: Option<MetaRef<'_>>) -> bool {
    match (a, b) {
        (Some(MetaRef::Float(x)), Some(MetaRef::Float(y))) => x == y || (x.is_nan() && y.is_nan()),
        _ => a == b,
    }
}

/// The values of a weight column as floats: any integer or float column is one (`null` where
/// the column has one); `None` for a column of another type.
fn weight_values(a: &ArrayRef) -> Option<Vec<Option<f64>>> {
    use arrow_array::types::{
        Int16Type, Int32Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
    };
    macro_rules! floats {
        ($t:ty) => {
            a.as_primitive::<$t>()
                .iter()
                .map(|v| v.map(|x| x as f64))
                .collect()
        };
    }
    Some(match a.data_type() {
        DataType::Float64 => a.as_primitive::<Float64Type>().iter().collect(),
        DataType::Float32 => floats!(Float32Type),
        DataType::Int64 => floats!(Int64Type),
        DataType::Int32 => floats!(Int32Type),
        DataType::Int16 => floats!(Int16Type),
        DataType::Int8 => floats!(Int8Type),
        DataType::UInt64 => floats!(UInt64Type),
        DataType::UInt32 => floats!(UInt32Type),
        DataType::UInt16 => floats!(UInt16Type),
        DataType::UInt8 => floats!(UInt8Type),
        DataType::Null => vec![None; a.len()],
        _ => return None,
    })
}

fn show(v: Option<MetaRef<'_>>) -> String {
    match v {
        None => "null".into(),
        Some(MetaRef::Bool(b)) => b.to_string(),
        Some(MetaRef::Int(i)) => i.to_string(),
        Some(MetaRef::Float(f)) => f.to_string(),
        Some(MetaRef::Str(s)) => format!("{s:?}"),
    }
}

/// The kind of value a column of `data_type` holds, as far as an edited table may differ from
/// the one `samples_metadata()` gave (a narrower int is still an int); `None` for any other.
fn kind(data_type: &DataType) -> Option<&'static str> {
    use DataType::*;
    match data_type {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 => Some("int"),
        Float16 | Float32 | Float64 => Some("float"),
        Utf8 | LargeUtf8 | Utf8View => Some("str"),
        Boolean => Some("bool"),
        _ => None,
    }
}

/// Validates an edited table (Arrow IPC stream) and returns the weights in global order. Every
/// physical sample must appear exactly once, identity and stored metadata unchanged, weights
/// positive and finite. On any violation nothing is returned, so nothing changes.
pub fn import(ds: &Dataset, ipc: &[u8]) -> Result<WeightTable> {
    let layout = layout(ds)?;
    let tables = tables(ds)?;
    let reader = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(ipc), None)
        .map_err(|e| Error::SamplesMetadata(format!("not an Arrow IPC stream: {e}")))?;
    let schema = reader.schema();
    let expected: Vec<&str> = layout
        .schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    let given: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let missing: Vec<&&str> = expected.iter().filter(|n| !given.contains(n)).collect();
    let extra: Vec<&&str> = given.iter().filter(|n| !expected.contains(n)).collect();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(Error::SamplesMetadata(format!(
            "columns must be {expected:?}; missing {missing:?}, unexpected {extra:?} \
             (only `weight` is editable: keep every other column as samples_metadata() returned it)"
        )));
    }
    let changed_types: Vec<String> = layout
        .schema
        .fields()
        .iter()
        .filter(|f| f.name() != WEIGHT)
        .filter_map(|f| {
            let given = schema
                .field_with_name(f.name())
                .expect("checked above")
                .data_type();
            // A str id column may carry the decimal ids of a cache with int ids.
            let id_as_text = f.name() == SAMPLE_ID && kind(given) == Some("str");
            (kind(given) != kind(f.data_type()) && !id_as_text).then(|| {
                format!(
                    "{:?} is {given}, where samples_metadata() gave {}",
                    f.name(),
                    f.data_type()
                )
            })
        })
        .collect();
    if !changed_types.is_empty() {
        return Err(Error::SamplesMetadata(format!(
            "column types were changed: {} (only `weight` is editable: keep every other column \
             as samples_metadata() returned it)",
            changed_types.join("; ")
        )));
    }
    let idx = |name: &str| schema.index_of(name).expect("checked above");
    let (cache_col, id_col, weight_col) = (idx(CACHE_ID), idx(SAMPLE_ID), idx(WEIGHT));
    let meta_cols: Vec<usize> = layout.columns.iter().map(|(n, _, _)| idx(n)).collect();
    let cache_index: HashMap<&str, usize> = ds
        .caches
        .iter()
        .enumerate()
        .map(|(i, c)| (c.name(), i))
        .collect();

    let total = ds.len() as usize;
    let mut weights = vec![f64::NAN; total];
    let mut seen = vec![false; total];
    let mut problems: Vec<String> = Vec::new();
    let mut problem_count = 0usize;
    let mut report = |problems: &mut Vec<String>, msg: String| {
        problem_count += 1;
        if problems.len() < MAX_QUOTED {
            problems.push(msg);
        }
    };
    let mut row = 0usize;
    for batch in reader {
        let batch = batch.map_err(|e| Error::SamplesMetadata(format!("unreadable batch: {e}")))?;
        let col = |c: usize, name: &str| {
            Col::new(batch.column(c)).ok_or_else(|| {
                let wanted = layout
                    .schema
                    .field_with_name(name)
                    .map(|f| format!(": keep the {} that samples_metadata() gave", f.data_type()))
                    .unwrap_or_default();
                Error::SamplesMetadata(format!(
                    "column {name:?} has unsupported type {}{wanted}",
                    batch.column(c).data_type()
                ))
            })
        };
        let caches = col(cache_col, CACHE_ID)?;
        let ids = col(id_col, SAMPLE_ID)?;
        let ws = weight_values(batch.column(weight_col)).ok_or_else(|| {
            Error::SamplesMetadata(format!(
                "column {WEIGHT:?} has unsupported type {}: weights are an integer or float column",
                batch.column(weight_col).data_type()
            ))
        })?;
        let metas = meta_cols
            .iter()
            .zip(&layout.columns)
            .map(|(&c, (n, _, _))| col(c, n))
            .collect::<Result<Vec<_>>>()?;
        for i in 0..batch.num_rows() {
            let r = row + i;
            let cache_name = match caches.get(i) {
                Some(MetaRef::Str(s)) => s,
                other => {
                    report(
                        &mut problems,
                        format!("row {r}: cache_id is {}", show(other)),
                    );
                    continue;
                }
            };
            let id = ids.get(i);
            let who = format!("row {r} (cache_id={cache_name:?}, sample_id={})", show(id));
            let Some(&c) = cache_index.get(cache_name) else {
                report(&mut problems, format!("{who}: unknown cache_id"));
                continue;
            };
            let cache = &ds.caches[c];
            // A str id column may carry the decimal ids of a cache with int ids.
            let parsed;
            let lookup = match (id, cache.manifest.sample_id_type) {
                (Some(MetaRef::Str(s)), FieldType::Int) => {
                    // Only the exact decimal rendering names an int id ("02" does not).
                    parsed = s.parse::<i64>().ok().filter(|v| v.to_string() == s);
                    parsed.map(MetaRef::Int)
                }
                (other, _) => other,
            };
            let found = match lookup {
                Some(id) => ds.find_sample(c, id)?,
                None => None,
            };
            let Some(local) = found else {
                report(
                    &mut problems,
                    format!("{who}: no such sample in cache {cache_name:?}"),
                );
                continue;
            };
            let g = (ds.cache_start(c) + local) as usize;
            if std::mem::replace(&mut seen[g], true) {
                report(&mut problems, format!("{who}: appears more than once"));
                continue;
            }
            for (m, (name, _, per_cache)) in metas.iter().zip(&layout.columns) {
                let stored = per_cache[c].map(|col| tables[c].value(col, local));
                let now = m.get(i);
                if !same(stored, now) {
                    report(
                        &mut problems,
                        format!("{who}: column {name:?} was changed from {} to {} (only `weight` is editable)", show(stored), show(now)),
                    );
                }
            }
            let Some(w) = ws.get(i).copied().flatten() else {
                report(&mut problems, format!("{who}: weight is null"));
                continue;
            };
            if !(w.is_finite() && w > 0.0) {
                report(
                    &mut problems,
                    format!("{who}: weight {w} is not positive and finite"),
                );
            }
            weights[g] = w;
        }
        row += batch.num_rows();
    }
    let absent = seen.iter().filter(|s| !**s).count();
    if absent > 0 {
        let quoted: Vec<String> = seen
            .iter()
            .enumerate()
            .filter(|(_, s)| !**s)
            .take(MAX_QUOTED)
            .map(|(g, _)| {
                let (c, local) = ds.locate(g as u64);
                format!(
                    "(cache_id={:?}, sample_id={})",
                    ds.caches[c].name(),
                    show(Some(tables[c].sample_id(local)))
                )
            })
            .collect();
        problem_count += 1;
        problems.push(format!(
            "{absent} samples are missing from the table, e.g. {}",
            quoted.join(", ")
        ));
    }
    if problem_count == 0 {
        if let Some(reason) = crate::sampler::weight_sum_problem(&weights) {
            problem_count += 1;
            problems.push(reason);
        }
    }
    if problem_count > 0 {
        let more = problem_count.saturating_sub(problems.len());
        let tail = if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        };
        return Err(Error::SamplesMetadata(format!(
            "{} problem(s), nothing was changed: {}{tail}",
            problem_count,
            problems.join("; ")
        )));
    }
    Ok(WeightTable::from_weights(weights))
}
