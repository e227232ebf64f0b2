//! Element types of tensor leaves and their sizes in bytes.

use std::fmt;

/// A tensor element type, named as in PyTorch (`torch.float32` -> `float32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    UInt8,
    Int8,
    Int16,
    UInt16,
    Int32,
    UInt32,
    Int64,
    UInt64,
    Float16,
    BFloat16,
    Float32,
    Float64,
    Complex32,
    Complex64,
    Complex128,
    Float8E4M3Fn,
    Float8E4M3FnUz,
    Float8E5M2,
    Float8E5M2FnUz,
    Float8E8M0Fnu,
}

const ALL: [DType; 21] = [
    DType::Bool,
    DType::UInt8,
    DType::Int8,
    DType::Int16,
    DType::UInt16,
    DType::Int32,
    DType::UInt32,
    DType::Int64,
    DType::UInt64,
    DType::Float16,
    DType::BFloat16,
    DType::Float32,
    DType::Float64,
    DType::Complex32,
    DType::Complex64,
    DType::Complex128,
    DType::Float8E4M3Fn,
    DType::Float8E4M3FnUz,
    DType::Float8E5M2,
    DType::Float8E5M2FnUz,
    DType::Float8E8M0Fnu,
];

impl DType {
    /// Every supported dtype.
    pub fn all() -> &'static [DType] {
        &ALL
    }

    /// Canonical name (PyTorch's, without the `torch.` prefix).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::UInt8 => "uint8",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::UInt16 => "uint16",
            DType::Int32 => "int32",
            DType::UInt32 => "uint32",
            DType::Int64 => "int64",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Complex32 => "complex32",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::Float8E4M3Fn => "float8_e4m3fn",
            DType::Float8E4M3FnUz => "float8_e4m3fnuz",
            DType::Float8E5M2 => "float8_e5m2",
            DType::Float8E5M2FnUz => "float8_e5m2fnuz",
            DType::Float8E8M0Fnu => "float8_e8m0fnu",
        }
    }

    /// Size of one element in bytes.
    pub fn itemsize(self) -> u64 {
        match self {
            DType::Bool | DType::UInt8 | DType::Int8 => 1,
            DType::Float8E4M3Fn
            | DType::Float8E4M3FnUz
            | DType::Float8E5M2
            | DType::Float8E5M2FnUz
            | DType::Float8E8M0Fnu => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 | DType::Complex32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }

    /// Parses a dtype name. Accepts the canonical names, a `torch.` prefix and
    /// PyTorch's aliases (`half`, `float`, `double`, `long`, ...).
    pub fn parse(name: &str) -> Option<DType> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let canonical = match bare {
            "half" => "float16",
            "float" => "float32",
            "double" => "float64",
            "short" => "int16",
            "int" => "int32",
            "long" => "int64",
            "cfloat" => "complex64",
            "cdouble" => "complex128",
            "chalf" => "complex32",
            other => other,
        };
        ALL.iter().copied().find(|d| d.name() == canonical)
    }

    /// A stable one-byte code used in fingerprints and binary encodings.
    pub fn code(self) -> u8 {
        ALL.iter().position(|d| *d == self).expect("dtype in ALL") as u8
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_codes_are_stable() {
        for (i, d) in DType::all().iter().enumerate() {
            assert_eq!(DType::parse(d.name()), Some(*d));
            assert_eq!(DType::parse(&format!("torch.{}", d.name())), Some(*d));
            assert_eq!(d.code() as usize, i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
        }
        assert_eq!(DType::parse("float"), Some(DType::Float32));
        assert_eq!(DType::parse("float33"), None);
        assert_eq!(DType::from_code(200), None);
    }
}
