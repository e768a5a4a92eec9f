//! Typed GGUF metadata values.

use std::fmt;

/// The on-disk type tag of a metadata value (`enum gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// `GGUF_TYPE_UINT8` (0).
    U8,
    /// `GGUF_TYPE_INT8` (1).
    I8,
    /// `GGUF_TYPE_UINT16` (2).
    U16,
    /// `GGUF_TYPE_INT16` (3).
    I16,
    /// `GGUF_TYPE_UINT32` (4).
    U32,
    /// `GGUF_TYPE_INT32` (5).
    I32,
    /// `GGUF_TYPE_FLOAT32` (6).
    F32,
    /// `GGUF_TYPE_BOOL` (7), one byte holding 0 or 1.
    Bool,
    /// `GGUF_TYPE_STRING` (8): `u64` length then UTF-8 bytes, no terminator.
    String,
    /// `GGUF_TYPE_ARRAY` (9): `i32` element type, `u64` count, then the elements.
    Array,
    /// `GGUF_TYPE_UINT64` (10).
    U64,
    /// `GGUF_TYPE_INT64` (11).
    I64,
    /// `GGUF_TYPE_FLOAT64` (12).
    F64,
}

impl ValueType {
    /// The type for an on-disk tag, or `None` if the tag is unknown.
    #[must_use]
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The on-disk tag.
    #[must_use]
    pub fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// The upper-case name gguf-py uses (`UINT32`, `STRING`, …).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "UINT8",
            Self::I8 => "INT8",
            Self::U16 => "UINT16",
            Self::I16 => "INT16",
            Self::U32 => "UINT32",
            Self::I32 => "INT32",
            Self::F32 => "FLOAT32",
            Self::Bool => "BOOL",
            Self::String => "STRING",
            Self::Array => "ARRAY",
            Self::U64 => "UINT64",
            Self::I64 => "INT64",
            Self::F64 => "FLOAT64",
        }
    }

    /// The smallest number of bytes one value of this type takes on disk. Used to reject
    /// element counts that could not fit in the rest of the file before allocating for them.
    #[must_use]
    pub(crate) fn min_encoded_size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Unsigned 8-bit integer.
    U8(u8),
    /// Signed 8-bit integer.
    I8(i8),
    /// Unsigned 16-bit integer.
    U16(u16),
    /// Signed 16-bit integer.
    I16(i16),
    /// Unsigned 32-bit integer.
    U32(u32),
    /// Signed 32-bit integer.
    I32(i32),
    /// 32-bit float.
    F32(f32),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Homogeneous array (possibly of arrays).
    Array(Array),
    /// Unsigned 64-bit integer.
    U64(u64),
    /// Signed 64-bit integer.
    I64(i64),
    /// 64-bit float.
    F64(f64),
}

/// A homogeneous metadata array, stored as a typed vector.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements (vocabularies, merges).
    String(Vec<String>),
    /// Nested arrays; each inner array carries its own element type.
    Array(Vec<Array>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
}

impl Value {
    /// The on-disk type tag of this value.
    #[must_use]
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// The value as an unsigned integer if it is a non-negative integer of any width.
    #[must_use]
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(u64::from(v)),
            Self::U16(v) => Some(u64::from(v)),
            Self::U32(v) => Some(u64::from(v)),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer if it is an integer of any width that fits in `i64`.
    #[must_use]
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(i64::from(v)),
            Self::I16(v) => Some(i64::from(v)),
            Self::I32(v) => Some(i64::from(v)),
            Self::I64(v) => Some(v),
            Self::U8(v) => Some(i64::from(v)),
            Self::U16(v) => Some(i64::from(v)),
            Self::U32(v) => Some(i64::from(v)),
            Self::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float if it is a float (f32 widened exactly) or an integer.
    #[must_use]
    #[allow(
        clippy::cast_precision_loss,
        reason = "metadata hyperparameters are small integers"
    )]
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(f64::from(v)),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice if it is a string.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool if it is a bool.
    #[must_use]
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array if it is one.
    #[must_use]
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// The on-disk type tag of the elements.
    #[must_use]
    pub fn element_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as strings if this is a string array.
    #[must_use]
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }
}

/// Short human-readable rendering: scalars in full, strings quoted and cut at 60 characters,
/// arrays as their type, length and first elements.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::U8(v) => write!(f, "{v}"),
            Self::I8(v) => write!(f, "{v}"),
            Self::U16(v) => write!(f, "{v}"),
            Self::I16(v) => write!(f, "{v}"),
            Self::U32(v) => write!(f, "{v}"),
            Self::I32(v) => write!(f, "{v}"),
            Self::F32(v) => write!(f, "{v}"),
            Self::Bool(v) => write!(f, "{v}"),
            Self::U64(v) => write!(f, "{v}"),
            Self::I64(v) => write!(f, "{v}"),
            Self::F64(v) => write!(f, "{v}"),
            Self::String(s) => write_short_str(f, s),
            Self::Array(a) => write!(f, "{a}"),
        }
    }
}

fn write_short_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    const MAX: usize = 60;
    match s.char_indices().nth(MAX) {
        Some((cut, _)) => write!(f, "{:?}… ({} bytes)", &s[..cut], s.len()),
        None => write!(f, "{s:?}"),
    }
}

impl fmt::Display for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 4;
        write!(f, "[{}; {}]", self.element_type(), self.len())?;
        if self.is_empty() {
            return Ok(());
        }
        f.write_str(" [")?;
        let n = self.len().min(SHOWN);
        for i in 0..n {
            if i > 0 {
                f.write_str(", ")?;
            }
            match self {
                Self::U8(v) => write!(f, "{}", v[i])?,
                Self::I8(v) => write!(f, "{}", v[i])?,
                Self::U16(v) => write!(f, "{}", v[i])?,
                Self::I16(v) => write!(f, "{}", v[i])?,
                Self::U32(v) => write!(f, "{}", v[i])?,
                Self::I32(v) => write!(f, "{}", v[i])?,
                Self::F32(v) => write!(f, "{}", v[i])?,
                Self::Bool(v) => write!(f, "{}", v[i])?,
                Self::String(v) => write_short_str(f, &v[i])?,
                Self::Array(v) => write!(f, "{}", v[i])?,
                Self::U64(v) => write!(f, "{}", v[i])?,
                Self::I64(v) => write!(f, "{}", v[i])?,
                Self::F64(v) => write!(f, "{}", v[i])?,
            }
        }
        if self.len() > n {
            f.write_str(", …")?;
        }
        f.write_str("]")
    }
}
