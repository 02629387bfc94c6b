//! Atomics on values read as arrays of fixed-width little-endian numbers (KV-Direct §3.2):
//! fetch-and-add, compare-and-swap, element-wise update with a scalar or a vector, reduce and
//! filter. Integers wrap; floats follow IEEE 754.

use dpukv_proto::{Cmp, Elem, ReduceOp, VecOp};

/// The value is not an array of the element type (or the operand's length differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeMismatch;

/// A number of any element type.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Num {
    U(u64),
    I(i64),
    F(f64),
}

fn read(elem: Elem, b: &[u8]) -> Num {
    match elem {
        Elem::U32 => Num::U(u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as u64),
        Elem::U64 => Num::U(u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))),
        Elem::I64 => Num::I(i64::from_le_bytes(b[..8].try_into().expect("8 bytes"))),
        Elem::F64 => Num::F(f64::from_le_bytes(b[..8].try_into().expect("8 bytes"))),
    }
}

fn write(elem: Elem, n: Num, out: &mut [u8]) {
    match (elem, n) {
        (Elem::U32, Num::U(v)) => out[..4].copy_from_slice(&(v as u32).to_le_bytes()),
        (Elem::U64, Num::U(v)) => out[..8].copy_from_slice(&v.to_le_bytes()),
        (Elem::I64, Num::I(v)) => out[..8].copy_from_slice(&v.to_le_bytes()),
        (Elem::F64, Num::F(v)) => out[..8].copy_from_slice(&v.to_le_bytes()),
        _ => unreachable!("numbers are read and written with one element type"),
    }
}

/// The scalar operand (8 bytes) as a number of `elem` (u32 operands use the low 4 bytes).
fn scalar(elem: Elem, operand: &[u8; 8]) -> Num {
    read(elem, operand)
}

fn apply(elem: Elem, op: VecOp, a: Num, b: Num) -> Num {
    let wrap32 = |v: u64| if elem == Elem::U32 { v as u32 as u64 } else { v };
    match (a, b) {
        (Num::U(x), Num::U(y)) => Num::U(wrap32(match op {
            VecOp::Add => x.wrapping_add(y),
            VecOp::Sub => x.wrapping_sub(y),
            VecOp::Mul => x.wrapping_mul(y),
            VecOp::Min => x.min(y),
            VecOp::Max => x.max(y),
            VecOp::Set => y,
        })),
        (Num::I(x), Num::I(y)) => Num::I(match op {
            VecOp::Add => x.wrapping_add(y),
            VecOp::Sub => x.wrapping_sub(y),
            VecOp::Mul => x.wrapping_mul(y),
            VecOp::Min => x.min(y),
            VecOp::Max => x.max(y),
            VecOp::Set => y,
        }),
        (Num::F(x), Num::F(y)) => Num::F(match op {
            VecOp::Add => x + y,
            VecOp::Sub => x - y,
            VecOp::Mul => x * y,
            VecOp::Min => x.min(y),
            VecOp::Max => x.max(y),
            VecOp::Set => y,
        }),
        _ => unreachable!("operands share the element type"),
    }
}

fn check(elem: Elem, v: &[u8]) -> Result<usize, TypeMismatch> {
    if v.len().is_multiple_of(elem.width()) { Ok(v.len() / elem.width()) } else { Err(TypeMismatch) }
}

/// Fetch-and-add on a u64 value (absent = 0): returns (old, new value bytes).
pub fn fetch_add(value: Option<&[u8]>, delta: u64) -> Result<(u64, Vec<u8>), TypeMismatch> {
    let old = match value {
        None => 0,
        Some(v) if v.len() == 8 => u64::from_le_bytes(v.try_into().expect("8 bytes")),
        Some(_) => return Err(TypeMismatch),
    };
    Ok((old, old.wrapping_add(delta).to_le_bytes().to_vec()))
}

/// Updates every element with `op` and a scalar.
pub fn vector_scalar(value: &[u8], elem: Elem, op: VecOp, operand: &[u8; 8]) -> Result<Vec<u8>, TypeMismatch> {
    check(elem, value)?;
    let w = elem.width();
    let s = scalar(elem, operand);
    let mut out = value.to_vec();
    for c in out.chunks_mut(w) {
        let n = apply(elem, op, read(elem, c), s);
        write(elem, n, c);
    }
    Ok(out)
}

/// Updates element i with `op` and element i of `operand`.
pub fn vector_vector(value: &[u8], elem: Elem, op: VecOp, operand: &[u8]) -> Result<Vec<u8>, TypeMismatch> {
    check(elem, value)?;
    if operand.len() != value.len() {
        return Err(TypeMismatch);
    }
    let w = elem.width();
    let mut out = value.to_vec();
    for (c, o) in out.chunks_mut(w).zip(operand.chunks(w)) {
        let n = apply(elem, op, read(elem, c), read(elem, o));
        write(elem, n, c);
    }
    Ok(out)
}

/// Reduces the elements (an empty array reduces to 0, or to the identity of min/max).
pub fn reduce(value: &[u8], elem: Elem, op: ReduceOp) -> Result<[u8; 8], TypeMismatch> {
    check(elem, value)?;
    let vop = match op {
        ReduceOp::Sum => VecOp::Add,
        ReduceOp::Min => VecOp::Min,
        ReduceOp::Max => VecOp::Max,
    };
    let init = match (elem, op) {
        (Elem::F64, ReduceOp::Sum) => Num::F(0.0),
        (Elem::F64, ReduceOp::Min) => Num::F(f64::INFINITY),
        (Elem::F64, ReduceOp::Max) => Num::F(f64::NEG_INFINITY),
        (Elem::I64, ReduceOp::Sum) => Num::I(0),
        (Elem::I64, ReduceOp::Min) => Num::I(i64::MAX),
        (Elem::I64, ReduceOp::Max) => Num::I(i64::MIN),
        (Elem::U32, ReduceOp::Min) => Num::U(u32::MAX as u64),
        (_, ReduceOp::Min) => Num::U(u64::MAX),
        (_, _) => Num::U(0),
    };
    let acc = value.chunks(elem.width()).fold(init, |a, c| apply(elem, vop, a, read(elem, c)));
    let mut out = [0u8; 8];
    match acc {
        Num::U(v) => out.copy_from_slice(&v.to_le_bytes()),
        Num::I(v) => out.copy_from_slice(&v.to_le_bytes()),
        Num::F(v) => out.copy_from_slice(&v.to_le_bytes()),
    }
    Ok(out)
}

/// The elements for which `element cmp operand` holds, in order.
pub fn filter(value: &[u8], elem: Elem, cmp: Cmp, operand: &[u8; 8]) -> Result<Vec<u8>, TypeMismatch> {
    check(elem, value)?;
    let s = scalar(elem, operand);
    let mut out = Vec::new();
    for c in value.chunks(elem.width()) {
        let x = read(elem, c);
        let o = match (x, s) {
            (Num::U(a), Num::U(b)) => a.partial_cmp(&b),
            (Num::I(a), Num::I(b)) => a.partial_cmp(&b),
            (Num::F(a), Num::F(b)) => a.partial_cmp(&b),
            _ => None,
        };
        let keep = match (cmp, o) {
            (_, None) => cmp == Cmp::Ne,
            (Cmp::Lt, Some(o)) => o.is_lt(),
            (Cmp::Le, Some(o)) => o.is_le(),
            (Cmp::Eq, Some(o)) => o.is_eq(),
            (Cmp::Ne, Some(o)) => o.is_ne(),
            (Cmp::Ge, Some(o)) => o.is_ge(),
            (Cmp::Gt, Some(o)) => o.is_gt(),
        };
        if keep {
            out.extend_from_slice(c);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// u64 and i64 vectors against plain Rust arithmetic on decoded arrays.
        #[test]
        fn integer_vectors_match_a_model(xs in proptest::collection::vec(any::<u64>(), 0..20), s in any::<u64>(), opi in 0usize..6) {
            let ops = [VecOp::Add, VecOp::Sub, VecOp::Mul, VecOp::Min, VecOp::Max, VecOp::Set];
            let op = ops[opi];
            let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
            let got = vector_scalar(&bytes, Elem::U64, op, &s.to_le_bytes()).expect("u64 vector");
            let want: Vec<u8> = xs.iter().map(|&x| match op {
                VecOp::Add => x.wrapping_add(s), VecOp::Sub => x.wrapping_sub(s), VecOp::Mul => x.wrapping_mul(s),
                VecOp::Min => x.min(s), VecOp::Max => x.max(s), VecOp::Set => s,
            }).flat_map(|x| x.to_le_bytes()).collect();
            prop_assert_eq!(got, want);
            let sum = reduce(&bytes, Elem::U64, ReduceOp::Sum).expect("sum");
            prop_assert_eq!(u64::from_le_bytes(sum), xs.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
            let max = reduce(&bytes, Elem::U64, ReduceOp::Max).expect("max");
            prop_assert_eq!(u64::from_le_bytes(max), xs.iter().copied().max().unwrap_or(0));
            let kept = filter(&bytes, Elem::U64, Cmp::Gt, &s.to_le_bytes()).expect("filter");
            let want: Vec<u8> = xs.iter().filter(|&&x| x > s).flat_map(|x| x.to_le_bytes()).collect();
            prop_assert_eq!(kept, want);
            let ys: Vec<i64> = xs.iter().map(|&x| x as i64).collect();
            let other: Vec<u8> = ys.iter().rev().flat_map(|y| y.to_le_bytes()).collect();
            let got = vector_vector(&bytes, Elem::I64, VecOp::Sub, &other).expect("i64 vector");
            let want: Vec<u8> = ys.iter().zip(ys.iter().rev()).map(|(a, b)| a.wrapping_sub(*b)).flat_map(|x| x.to_le_bytes()).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn u32_and_f64_vectors(xs in proptest::collection::vec(any::<u32>(), 0..20), s in any::<u32>(), fs in proptest::collection::vec(-1e6f64..1e6, 0..10)) {
            let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mut op8 = [0u8; 8];
            op8[..4].copy_from_slice(&s.to_le_bytes());
            let got = vector_scalar(&bytes, Elem::U32, VecOp::Add, &op8).expect("u32 add");
            let want: Vec<u8> = xs.iter().flat_map(|x| x.wrapping_add(s).to_le_bytes()).collect();
            prop_assert_eq!(got, want);
            let fb: Vec<u8> = fs.iter().flat_map(|x| x.to_le_bytes()).collect();
            let sum = f64::from_le_bytes(reduce(&fb, Elem::F64, ReduceOp::Sum).expect("f64 sum"));
            prop_assert!((sum - fs.iter().sum::<f64>()).abs() < 1e-3);
        }
    }

    #[test]
    fn type_mismatches() {
        assert_eq!(fetch_add(Some(b"abc"), 1), Err(TypeMismatch));
        assert_eq!(fetch_add(None, 5).map(|r| r.0), Ok(0));
        assert_eq!(vector_scalar(&[0; 7], Elem::U64, VecOp::Add, &[0; 8]), Err(TypeMismatch));
        assert_eq!(vector_vector(&[0; 8], Elem::U32, VecOp::Add, &[0; 4]), Err(TypeMismatch));
    }
}
