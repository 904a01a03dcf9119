//! Per-sample metadata: the schema, typed values, and the Arrow IPC table (`metadata.arrow`).

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{BooleanBuilder, Float64Builder, Int64Builder, StringBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int64Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field as ArrowField, Schema, SchemaRef};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hashed_file::{create_file, finish_file, HashingWriter};

/// The name of the identity column (and of the optional user metadata key feeding it).
pub const SAMPLE_ID: &str = "sample_id";
/// Rows per record batch in `metadata.arrow`: the writer's memory for metadata stays bounded.
pub const BATCH_ROWS: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FieldType {
    Bool,
    Int,
    Float,
    Str,
}

impl FieldType {
    pub fn as_str(self) -> &'static str {
        match self {
            FieldType::Bool => "bool",
            FieldType::Int => "int",
            FieldType::Float => "float",
            FieldType::Str => "str",
        }
    }

    fn arrow(self) -> DataType {
        match self {
            FieldType::Bool => DataType::Boolean,
            FieldType::Int => DataType::Int64,
            FieldType::Float => DataType::Float64,
            FieldType::Str => DataType::Utf8,
        }
    }

    fn from_arrow(dt: &DataType) -> Option<Self> {
        Some(match dt {
            DataType::Boolean => FieldType::Bool,
            DataType::Int64 => FieldType::Int,
            DataType::Float64 => FieldType::Float,
            DataType::Utf8 => FieldType::Str,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Field {
    pub name: String,
    #[serde(rename = "type")]
    pub dtype: FieldType,
}

/// One metadata value as given by the user.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl MetaValue {
    pub fn dtype(&self) -> FieldType {
        match self {
            MetaValue::Bool(_) => FieldType::Bool,
            MetaValue::Int(_) => FieldType::Int,
            MetaValue::Float(_) => FieldType::Float,
            MetaValue::Str(_) => FieldType::Str,
        }
    }
}

/// A value as it appears in a record's JSON.
struct JsonValue<'a>(&'a MetaValue);

impl Serialize for JsonValue<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self.0 {
            MetaValue::Bool(b) => s.serialize_bool(*b),
            MetaValue::Int(i) => s.serialize_i64(*i),
            // JSON has no NaN or infinities; the schema says `float`, so the strings are unambiguous.
            MetaValue::Float(f) if f.is_nan() => s.serialize_str("NaN"),
            MetaValue::Float(f) if f.is_infinite() => {
                s.serialize_str(if *f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            MetaValue::Float(f) => s.serialize_f64(*f),
            MetaValue::Str(v) => s.serialize_str(v),
        }
    }
}

/// A borrowed metadata value read back from the table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetaRef<'a> {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
}

/// Encodes the metadata embedded in a record: a JSON object with its keys sorted by their bytes
/// (readers must not depend on key order). The order is worked out once per schema, and a record
/// is serialised straight from its values, without building a JSON map.
pub struct RecordMetadataJson {
    order: Vec<usize>,
}

impl RecordMetadataJson {
    pub fn new(fields: &[Field]) -> Self {
        let mut order: Vec<usize> = (0..fields.len()).collect();
        order.sort_by(|&a, &b| fields[a].name.cmp(&fields[b].name));
        RecordMetadataJson { order }
    }

    /// The JSON of one record's `values`, given in the order of `fields`.
    pub fn encode(&self, fields: &[Field], values: &[MetaValue]) -> Vec<u8> {
        let record = SortedRecord {
            order: &self.order,
            fields,
            values,
        };
        serde_json::to_vec(&record).expect("JSON of plain values")
    }
}

struct SortedRecord<'a> {
    order: &'a [usize],
    fields: &'a [Field],
    values: &'a [MetaValue],
}

impl Serialize for SortedRecord<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.order.len()))?;
        for &i in self.order {
            map.serialize_entry(&self.fields[i].name, &JsonValue(&self.values[i]))?;
        }
        map.end()
    }
}

/// The Arrow schema of `metadata.arrow`: `sample_id` first, then the other fields in order.
pub fn arrow_schema(fields: &[Field], sample_id_type: FieldType) -> SchemaRef {
    let mut cols = vec![ArrowField::new(SAMPLE_ID, sample_id_type.arrow(), false)];
    cols.extend(
        fields
            .iter()
            .filter(|f| f.name != SAMPLE_ID)
            .map(|f| ArrowField::new(&f.name, f.dtype.arrow(), false)),
    );
    Arc::new(Schema::new(cols))
}

enum ColumnBuilder {
    Bool(BooleanBuilder),
    Int(Int64Builder),
    Float(Float64Builder),
    Str(StringBuilder),
}

impl ColumnBuilder {
    fn new(dtype: FieldType) -> Self {
        match dtype {
            FieldType::Bool => ColumnBuilder::Bool(BooleanBuilder::with_capacity(BATCH_ROWS)),
            FieldType::Int => ColumnBuilder::Int(Int64Builder::with_capacity(BATCH_ROWS)),
            FieldType::Float => ColumnBuilder::Float(Float64Builder::with_capacity(BATCH_ROWS)),
            FieldType::Str => ColumnBuilder::Str(StringBuilder::new()),
        }
    }

    fn push(&mut self, v: &MetaValue) {
        match (self, v) {
            (ColumnBuilder::Bool(b), MetaValue::Bool(x)) => b.append_value(*x),
            (ColumnBuilder::Int(b), MetaValue::Int(x)) => b.append_value(*x),
            (ColumnBuilder::Float(b), MetaValue::Float(x)) => b.append_value(*x),
            (ColumnBuilder::Str(b), MetaValue::Str(x)) => b.append_value(x),
            _ => unreachable!("values are checked against the schema before they are pushed"),
        }
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::Bool(b) => Arc::new(b.finish()),
            ColumnBuilder::Int(b) => Arc::new(b.finish()),
            ColumnBuilder::Float(b) => Arc::new(b.finish()),
            ColumnBuilder::Str(b) => Arc::new(b.finish()),
        }
    }
}

/// Streams rows into `metadata.arrow` in batches of `BATCH_ROWS`.
pub struct MetadataWriter {
    schema: SchemaRef,
    /// For each arrow column, the position of its value in a row's `values` (schema order).
    source_of_column: Vec<Option<usize>>,
    builders: Vec<ColumnBuilder>,
    rows_in_batch: usize,
    writer: arrow_ipc::writer::FileWriter<HashingWriter<BufWriter<File>>>,
    path: std::path::PathBuf,
}

impl MetadataWriter {
    pub fn create(path: &Path, fields: &[Field], sample_id_type: FieldType) -> Result<Self> {
        let schema = arrow_schema(fields, sample_id_type);
        let writer = arrow_ipc::writer::FileWriter::try_new(create_file(path)?, &schema)
            .map_err(|e| Error::io("write", path, std::io::Error::other(e)))?;
        let mut source_of_column = vec![fields.iter().position(|f| f.name == SAMPLE_ID)];
        source_of_column.extend(
            fields
                .iter()
                .enumerate()
                .filter(|(_, f)| f.name != SAMPLE_ID)
                .map(|(i, _)| Some(i)),
        );
        let builders = schema
            .fields()
            .iter()
            .map(|f| ColumnBuilder::new(FieldType::from_arrow(f.data_type()).unwrap()))
            .collect();
        Ok(MetadataWriter {
            schema,
            source_of_column,
            builders,
            rows_in_batch: 0,
            writer,
            path: path.to_owned(),
        })
    }

    /// Appends one row. `sample_id` is the identity (the user's or the position).
    pub fn push(&mut self, sample_id: &MetaValue, values: &[MetaValue]) -> Result<()> {
        for (builder, source) in self.builders.iter_mut().zip(&self.source_of_column) {
            match source {
                Some(i) => builder.push(&values[*i]),
                None => builder.push(sample_id),
            }
        }
        self.rows_in_batch += 1;
        if self.rows_in_batch == BATCH_ROWS {
            self.flush_batch()?;
        }
        Ok(())
    }

    fn flush_batch(&mut self) -> Result<()> {
        if self.rows_in_batch == 0 {
            return Ok(());
        }
        let columns = self
            .builders
            .iter_mut()
            .map(ColumnBuilder::finish)
            .collect();
        let batch = RecordBatch::try_new(self.schema.clone(), columns)
            .map_err(|e| Error::io("write", &self.path, std::io::Error::other(e)))?;
        self.writer
            .write(&batch)
            .map_err(|e| Error::io("write", &self.path, std::io::Error::other(e)))?;
        self.rows_in_batch = 0;
        Ok(())
    }

    /// Writes the last batch and the footer, syncs the file, and returns its length and
    /// checksum.
    pub fn finish(mut self) -> Result<(u64, String)> {
        self.flush_batch()?;
        self.writer
            .finish()
            .map_err(|e| Error::io("write", &self.path, std::io::Error::other(e)))?;
        let file = self
            .writer
            .into_inner()
            .map_err(|e| Error::io("write", &self.path, std::io::Error::other(e)))?;
        finish_file(file, &self.path)
    }
}

/// `metadata.arrow` loaded for lookups: record batches plus their starting rows.
pub struct MetadataTable {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
    starts: Vec<u64>,
    rows: u64,
    /// For each user field (schema order), its column in the table.
    field_columns: Vec<usize>,
    pub fields: Vec<Field>,
}

/// Bytes before the first message of an Arrow IPC file: the magic padded to 8 bytes.
const IPC_FILE_HEAD: usize = 8;
/// Bytes after the footer: its length (4 bytes) and the magic again.
const IPC_FILE_TRAILER: usize = 10;

/// The bytes of `bytes` from `offset` for `len` bytes, or a reason naming `what` when that range
/// is not inside `limit` (the first byte past the region it must lie in). Every offset and length
/// read from the file goes through here before it is used or anything is allocated for it.
fn checked_range(
    what: &str,
    offset: i64,
    len: i64,
    limit: usize,
) -> Result<(usize, usize), String> {
    let start = usize::try_from(offset).map_err(|_| format!("{what} has offset {offset}"))?;
    let n = usize::try_from(len).map_err(|_| format!("{what} has length {len}"))?;
    match start.checked_add(n) {
        Some(end) if end <= limit => Ok((start, n)),
        _ => Err(format!(
            "{what} at offset {offset} with length {len} lies past the end of its region ({limit} bytes)"
        )),
    }
}

/// The checks of one record batch block before arrow-ipc decodes it: the block lies between the
/// file's head and its footer, its message is a record batch whose buffers all lie inside its
/// body, and nothing is compressed (DatasetRT never writes compressed metadata).
fn check_block(
    bytes: &[u8],
    i: usize,
    block: &arrow_ipc::Block,
    footer_start: usize,
) -> Result<(usize, usize), String> {
    let what = format!("record batch block {i}");
    let meta_len = i64::from(block.metaDataLength());
    if meta_len < 8 {
        return Err(format!(
            "{what} has a metadata length of {meta_len} (at least 8 expected)"
        ));
    }
    if block.bodyLength() < 0 {
        return Err(format!(
            "{what} has a body length of {}",
            block.bodyLength()
        ));
    }
    let total = meta_len
        .checked_add(block.bodyLength())
        .ok_or_else(|| format!("{what} has a body length of {}", block.bodyLength()))?;
    let (start, len) = checked_range(&what, block.offset(), total, footer_start)?;
    if start < IPC_FILE_HEAD {
        return Err(format!(
            "{what} starts at offset {start}, inside the file's magic"
        ));
    }
    let meta = &bytes[start..start + meta_len as usize];
    let flatbuffer = if meta[..4] == [0xff; 4] {
        &meta[8..]
    } else {
        &meta[4..]
    };
    let message = arrow_ipc::root_as_message(flatbuffer)
        .map_err(|e| format!("{what}: unreadable message: {e}"))?;
    let batch = message
        .header_as_record_batch()
        .ok_or_else(|| format!("{what} does not hold a record batch"))?;
    if batch.compression().is_some() {
        return Err(format!(
            "{what} is compressed; DatasetRT writes uncompressed metadata"
        ));
    }
    if batch.length() < 0 {
        return Err(format!("{what} claims {} rows", batch.length()));
    }
    let body = block.bodyLength() as usize;
    for (j, b) in batch.buffers().into_iter().flatten().enumerate() {
        checked_range(
            &format!("{what}, buffer {j},"),
            b.offset(),
            b.length(),
            body,
        )?;
    }
    Ok((start, len))
}

/// Parses the Arrow IPC file in `buffer` into its schema and record batches, whose arrays share
/// `buffer`. Every size in the file is checked against the length of `buffer` before it is used,
/// so nothing is allocated for the columns beyond what the file holds.
fn decode_ipc_file(buffer: &arrow_buffer::Buffer) -> Result<(Schema, Vec<RecordBatch>), String> {
    let bytes = buffer.as_slice();
    const MAGIC: &[u8; 6] = b"ARROW1";
    if bytes.len() < IPC_FILE_HEAD + IPC_FILE_TRAILER {
        return Err(format!(
            "not an Arrow IPC file: {} bytes is too short",
            bytes.len()
        ));
    }
    if &bytes[..MAGIC.len()] != MAGIC {
        return Err("not an Arrow IPC file: the file does not start with its magic".into());
    }
    let trailer_start = bytes.len() - IPC_FILE_TRAILER;
    let footer_len =
        arrow_ipc::reader::read_footer_length(bytes[trailer_start..].try_into().expect("10 bytes"))
            .map_err(|e| format!("not an Arrow IPC file: {e}"))?;
    let footer_start = trailer_start
        .checked_sub(footer_len)
        .filter(|&s| s >= IPC_FILE_HEAD)
        .ok_or_else(|| {
            format!("not an Arrow IPC file: its footer length {footer_len} exceeds the file")
        })?;
    let footer = arrow_ipc::root_as_footer(&bytes[footer_start..trailer_start])
        .map_err(|e| format!("not an Arrow IPC file: unreadable footer: {e}"))?;
    let ipc_schema = footer
        .schema()
        .ok_or("not an Arrow IPC file: the footer has no schema")?;
    if !ipc_schema.endianness().equals_to_target_endianness() {
        return Err("the file was written on a machine of the other byte order".into());
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(ipc_schema)
        .map_err(|e| format!("unreadable schema: {e}"))?;
    if footer.dictionaries().is_some_and(|d| !d.is_empty()) {
        return Err("the file holds dictionary batches; DatasetRT writes none".into());
    }
    let blocks = footer
        .recordBatches()
        .ok_or("not an Arrow IPC file: the footer lists no record batches")?;
    let mut ranges = Vec::with_capacity(blocks.len().min(bytes.len() / 8));
    for (i, block) in blocks.iter().enumerate() {
        ranges.push((check_block(bytes, i, block, footer_start)?, *block));
    }
    let decoder = arrow_ipc::reader::FileDecoder::new(Arc::new(schema.clone()), footer.version());
    let mut batches = Vec::with_capacity(ranges.len());
    for (i, ((start, len), block)) in ranges.into_iter().enumerate() {
        let batch = decoder
            .read_record_batch(&block, &buffer.slice_with_length(start, len))
            .map_err(|e| format!("unreadable record batch {i}: {e}"))?
            .ok_or_else(|| format!("record batch block {i} holds no record batch"))?;
        batches.push(batch);
    }
    Ok((schema, batches))
}

impl MetadataTable {
    /// Decodes the IPC file held in `bytes` (into one copy of them) and checks it against the
    /// manifest's schema.
    ///
    /// Takes the file's bytes, not a path, so that fuzzers and tests can call it directly. It
    /// never panics: a panic inside the Arrow decoder (a case the checks above did not foresee)
    /// is caught and returned as a reason like every other.
    pub fn decode(
        bytes: &[u8],
        fields: &[Field],
        sample_id_type: FieldType,
        expected_rows: u64,
    ) -> std::result::Result<Self, String> {
        Self::decode_buffer(
            arrow_buffer::Buffer::from_slice_ref(bytes),
            fields,
            sample_id_type,
            expected_rows,
        )
    }

    /// [`MetadataTable::decode`] of the file held in `bytes`, whose columns then share `bytes`
    /// without a copy (a buffer over a map of the file serves them from the map).
    pub fn decode_buffer(
        bytes: arrow_buffer::Buffer,
        fields: &[Field],
        sample_id_type: FieldType,
        expected_rows: u64,
    ) -> std::result::Result<Self, String> {
        std::panic::catch_unwind(|| {
            Self::decode_checked(&bytes, fields, sample_id_type, expected_rows)
        })
        .unwrap_or_else(|panic| {
            Err(format!(
                "the Arrow IPC decoder failed on this file: {}",
                crate::pool::panic_payload(&panic)
            ))
        })
    }

    fn decode_checked(
        bytes: &arrow_buffer::Buffer,
        fields: &[Field],
        sample_id_type: FieldType,
        expected_rows: u64,
    ) -> std::result::Result<Self, String> {
        let (schema, decoded) = decode_ipc_file(bytes)?;
        let expected = arrow_schema(fields, sample_id_type);
        let names = |s: &Schema| {
            s.fields()
                .iter()
                .map(|f| format!("{}:{}", f.name(), f.data_type()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if schema.fields().len() != expected.fields().len()
            || schema
                .fields()
                .iter()
                .zip(expected.fields())
                .any(|(a, b)| a.name() != b.name() || a.data_type() != b.data_type())
        {
            return Err(format!(
                "schema [{}] does not match the manifest's [{}]",
                names(&schema),
                names(&expected)
            ));
        }
        let mut batches = Vec::new();
        let mut starts = Vec::new();
        let mut rows = 0u64;
        for batch in decoded {
            if batch.columns().iter().any(|c| c.null_count() > 0) {
                return Err("null values in metadata".into());
            }
            starts.push(rows);
            rows += batch.num_rows() as u64;
            batches.push(batch);
        }
        if rows != expected_rows {
            return Err(format!("{rows} rows, the manifest says {expected_rows}"));
        }
        let field_columns = fields
            .iter()
            .map(|f| expected.index_of(&f.name).expect("schema checked above"))
            .collect();
        Ok(MetadataTable {
            schema: expected,
            batches,
            starts,
            rows,
            field_columns,
            fields: fields.to_vec(),
        })
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// (record batch, row within it) of a row of the table.
    pub fn locate(&self, row: u64) -> (usize, usize) {
        let b = self.starts.partition_point(|&s| s <= row) - 1;
        (b, (row - self.starts[b]) as usize)
    }

    /// The value of column `col` (an Arrow column index) at `row`.
    pub fn value(&self, col: usize, row: u64) -> MetaRef<'_> {
        let (b, r) = self.locate(row);
        let array = self.batches[b].column(col);
        match array.data_type() {
            DataType::Boolean => MetaRef::Bool(array.as_boolean().value(r)),
            DataType::Int64 => MetaRef::Int(array.as_primitive::<Int64Type>().value(r)),
            DataType::Float64 => MetaRef::Float(array.as_primitive::<Float64Type>().value(r)),
            DataType::Utf8 => MetaRef::Str(array.as_string::<i32>().value(r)),
            other => unreachable!("schema checked on load, found {other}"),
        }
    }

    /// The user's metadata of one row, in schema order.
    pub fn row(&self, row: u64) -> impl Iterator<Item = (&str, MetaRef<'_>)> + '_ {
        self.fields
            .iter()
            .zip(&self.field_columns)
            .map(move |(f, &c)| (f.name.as_str(), self.value(c, row)))
    }

    /// The identity of one row.
    pub fn sample_id(&self, row: u64) -> MetaRef<'_> {
        self.value(0, row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the writer embedded before `RecordMetadataJson`: a `serde_json` map, which sorts its
    /// keys. The records it wrote must stay byte for byte what the writer writes.
    fn via_json_map(fields: &[Field], values: &[MetaValue]) -> Vec<u8> {
        let mut map = serde_json::Map::new();
        for (f, v) in fields.iter().zip(values) {
            let json: serde_json::Value = match v {
                MetaValue::Bool(b) => (*b).into(),
                MetaValue::Int(i) => (*i).into(),
                MetaValue::Float(f) if f.is_nan() => "NaN".into(),
                MetaValue::Float(f) if f.is_infinite() => {
                    if *f > 0.0 { "Infinity" } else { "-Infinity" }.into()
                }
                MetaValue::Float(f) => (*f).into(),
                MetaValue::Str(s) => s.as_str().into(),
            };
            map.insert(f.name.clone(), json);
        }
        serde_json::to_vec(&serde_json::Value::Object(map)).unwrap()
    }

    fn value() -> impl Strategy<Value = MetaValue> {
        prop_oneof![
            any::<bool>().prop_map(MetaValue::Bool),
            any::<i64>().prop_map(MetaValue::Int),
            any::<f64>().prop_map(MetaValue::Float),
            prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(f64::NEG_INFINITY)]
                .prop_map(MetaValue::Float),
            ".{0,12}".prop_map(MetaValue::Str),
        ]
    }

    proptest! {
        #[test]
        fn records_keep_their_bytes(
            entries in proptest::collection::btree_map(".{0,8}", value(), 0..8),
            rotate in 0usize..8,
        ) {
            // Unique names in an arbitrary (rotated) order, as a source's first sample gives them.
            let mut entries: Vec<(String, MetaValue)> = entries.into_iter().collect();
            let len = entries.len().max(1);
            entries.rotate_left(rotate % len);
            let fields: Vec<Field> = entries
                .iter()
                .map(|(name, v)| Field { name: name.clone(), dtype: v.dtype() })
                .collect();
            let values: Vec<MetaValue> = entries.into_iter().map(|(_, v)| v).collect();
            let encoded = RecordMetadataJson::new(&fields).encode(&fields, &values);
            prop_assert_eq!(encoded, via_json_map(&fields, &values));
        }
    }
}
