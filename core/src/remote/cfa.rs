//! Frames whose call-frame information the DWARF unwinder (framehop) does not evaluate: a CFA
//! given by an expression that reads it from the stack — `DW_OP_breg<fp> k; DW_OP_deref;
//! DW_OP_plus_uconst n` — with the return address and the caller's frame pointer saved at
//! offsets from it. Corosensei's `stack_init_trampoline`, the root of every coroutine stack,
//! is described so: its CFA is the parent stack, whose address is in the coroutine's parent
//! link. framehop falls back to the frame-pointer chain there, which reads the coroutine's
//! entry function's address as a return address: a bogus `?? (coroutine_func)` frame in
//! every thread that runs a fiber, between the trampoline and `switch_and_link`.
//!
//! These rows are read once per image from its `.eh_frame`, and the walk steps them itself.
//! Any other expression is left to framehop, as before.

use addr2line::gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, NativeEndian, RegisterRule, UnwindContext,
    UnwindSection,
};
use object::{Object, ObjectSection};

use crate::arch::dwarf::{FP, RA};

/// One row of an image's call-frame information stepped by [`DerefRow::step`] (process
/// addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DerefRow {
    pub start: u64,
    pub end: u64,
    /// The CFA: the word at the frame pointer + `fp_off`, plus `plus`.
    fp_off: i64,
    plus: u64,
    /// Where the return address and the caller's frame pointer are, from the CFA.
    ra_at: i64,
    fp_at: i64,
}

impl DerefRow {
    /// The caller's `(ip, sp, fp)` from the frame pointer `fp`, reading words with `read`.
    pub(super) fn step(
        &self,
        fp: u64,
        read: &mut dyn FnMut(u64) -> Option<u64>,
    ) -> Option<(u64, u64, u64)> {
        let cfa = read(fp.checked_add_signed(self.fp_off)?)?.checked_add(self.plus)?;
        let ra = read(cfa.checked_add_signed(self.ra_at)?)?;
        let caller_fp = read(cfa.checked_add_signed(self.fp_at)?)?;
        Some((ra, cfa, caller_fp))
    }
}

/// The rows of `obj`'s `.eh_frame` (loaded with `bias`) that [`DerefRow`] steps.
pub(super) fn deref_rows(obj: &object::File<'_>, bias: u64) -> Vec<DerefRow> {
    let Some(sec) = obj.section_by_name(".eh_frame") else {
        return Vec::new();
    };
    let Ok(data) = sec.uncompressed_data() else {
        return Vec::new();
    };
    let eh = EhFrame::new(&data, NativeEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(sec.address());
    if let Some(text) = obj.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    let mut ctx = UnwindContext::new();
    let mut out = Vec::new();
    let mut entries = eh.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        // A first look at the instructions: only FDEs with a CFA expression are unwound
        // into rows (nearly none are).
        let mut ins = fde.instructions(&eh, &bases);
        let mut has_expression = false;
        while let Ok(Some(i)) = ins.next() {
            if matches!(
                i,
                addr2line::gimli::CallFrameInstruction::DefCfaExpression { .. }
            ) {
                has_expression = true;
                break;
            }
        }
        if !has_expression {
            continue;
        }
        let Ok(mut rows) = fde.rows(&eh, &bases, &mut ctx) else {
            continue;
        };
        while let Ok(Some(row)) = rows.next_row() {
            let CfaRule::Expression(expr) = row.cfa() else {
                continue;
            };
            let Ok(bytes) = expr.get(&eh).map(|e| e.0) else {
                continue;
            };
            let Some((fp_off, plus)) = deref_fp_expression(bytes.slice()) else {
                continue;
            };
            let (Some(RegisterRule::Offset(ra_at)), Some(RegisterRule::Offset(fp_at))) =
                (row.register(RA), row.register(FP))
            else {
                continue;
            };
            out.push(DerefRow {
                start: row.start_address().wrapping_add(bias),
                end: row.end_address().wrapping_add(bias),
                fp_off,
                plus,
                ra_at,
                fp_at,
            });
        }
    }
    out
}

/// `(k, n)` of the expression `DW_OP_breg<fp> k; DW_OP_deref; DW_OP_plus_uconst n` (`n`
/// optional), else `None`.
fn deref_fp_expression(b: &[u8]) -> Option<(i64, u64)> {
    const DW_OP_BREG0: u8 = 0x70;
    const DW_OP_DEREF: u8 = 0x06;
    const DW_OP_PLUS_UCONST: u8 = 0x23;
    let breg = DW_OP_BREG0.checked_add(u8::try_from(FP.0).ok()?)?;
    let (&op, rest) = b.split_first()?;
    if op != breg {
        return None;
    }
    let (k, rest) = sleb(rest)?;
    let (&deref, rest) = rest.split_first()?;
    if deref != DW_OP_DEREF {
        return None;
    }
    match rest.split_first() {
        None => Some((k, 0)),
        Some((&DW_OP_PLUS_UCONST, rest)) => {
            let (n, rest) = uleb(rest)?;
            rest.is_empty().then_some((k, n))
        }
        Some(_) => None,
    }
}

fn uleb(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

fn sleb(b: &[u8]) -> Option<(i64, &[u8])> {
    let mut v = 0i64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= i64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            let shift = 7 * (i + 1);
            if shift < 64 && byte & 0x40 != 0 {
                v |= -1i64 << shift;
            }
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deref_expression_is_read_and_others_are_not() {
        let breg = 0x70 + FP.0 as u8;
        // Corosensei's: breg(fp) 0; deref; plus_uconst 24.
        assert_eq!(
            deref_fp_expression(&[breg, 0, 0x06, 0x23, 0x18]),
            Some((0, 24))
        );
        // A negative offset (sleb -16), no addition.
        assert_eq!(deref_fp_expression(&[breg, 0x70, 0x06]), Some((-16, 0)));
        for other in [
            &[breg + 1, 0, 0x06, 0x23, 0x18][..],
            &[breg, 0, 0x23, 0x18],
            &[breg, 0, 0x06, 0x23, 0x18, 0x06],
            &[breg, 0, 0x06, 0x22],
            &[breg],
            &[],
        ] {
            assert_eq!(deref_fp_expression(other), None, "{other:x?}");
        }
    }

    #[test]
    fn a_row_steps_through_the_word_it_names() {
        let row = DerefRow {
            start: 0,
            end: 1,
            fp_off: 0,
            plus: 24,
            ra_at: -16,
            fp_at: -24,
        };
        // The parent link at 0x1000 holds 0x2000, the parent stack: its saved fp at 0x2000,
        // the return address at 0x2008.
        let mut mem = |a: u64| match a {
            0x1000 => Some(0x2000),
            0x2000 => Some(0x3000),
            0x2008 => Some(0x4444),
            _ => None,
        };
        assert_eq!(row.step(0x1000, &mut mem), Some((0x4444, 0x2018, 0x3000)));
        assert_eq!(row.step(0x5000, &mut mem), None);
    }
}
