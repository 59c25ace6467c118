//! Compact unwind rules, cached per return address: the fast path of a DWARF step.
//!
//! framehop evaluates an image's call-frame information (CFI) once per code address and
//! caches the resulting rule, but keeps its rules to itself, so every frame still goes through
//! its generic step (a cache probe modulo 509, the rule behind a trait, reads through a
//! closure). Here the CFI row that covers a return address is read once (gimli, through the
//! image's `.eh_frame_hdr` search table, with fixed-size storage: no allocation, so this also
//! runs in a signal handler) and reduced to one of three compact rules that the walker
//! applies inline:
//! * `Sp`: the CFA is `rsp + n`; `rbp` is unchanged or saved at a fixed offset from the CFA;
//! * `Fp`: the standard frame record (`CFA = rbp + 16`, `rbp` saved at `CFA - 16`);
//! * `End`: the return address is undefined (the outermost frame).
//!
//! In every case the return address is at `CFA - 8`. A row without such a form (a CFA given
//! by a DWARF expression, as in PLT stubs; the return address elsewhere; a CFA based on `rbp`
//! at another offset; too many register rules for the fixed storage), an address without CFI,
//! and the first frame of a walk (an interrupted pc may lie in a prologue, where framehop also
//! looks at the instructions) are stepped by framehop, as before.
//!
//! The rules mean what framehop's rules of the same shape mean (`OffsetSp`,
//! `OffsetSpAndRestoreBp`, `UseFramePointer`, `EndOfStack`), with the same checks; a test
//! compares both on the same stacks. (One difference: framehop finds no module for an image
//! whose addresses lie 4 GiB or more above its load bias and then follows frame pointers;
//! the compact rules read that image's CFI.) How a result can be wrong: as with framehop, only through
//! CFI that does not describe the code (hand-written assembly with wrong annotations), or a
//! stale cache entry — entries belong to one image table and are dropped when the table is
//! replaced, so a library unloaded and replaced at the same address between two refreshes is
//! the one case that can reuse a stale rule.

use addr2line::gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EhFrameOffset, LittleEndian, Pointer,
    RegisterRule, UnwindContext, UnwindContextStorage, UnwindSection, UnwindTableRow,
};

use crate::arch::dwarf;
use crate::image::ImageTable;

/// A compact unwind rule for one code address (x86_64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rule {
    /// No compact form: framehop steps this frame.
    Other,
    /// The outermost frame: the walk ends here.
    End,
    /// `CFA = rsp + 8 * cfa8`; `rbp` is unchanged when `bp8 == 0`, else saved at
    /// `CFA + 8 * bp8` (never at the CFA itself: that word belongs to the caller).
    Sp { cfa8: u16, bp8: i16 },
    /// `CFA = rbp + 16`, `rbp` saved at `CFA - 16`: the frame record.
    Fp,
}

/// Fixed-size storage for gimli's CFI evaluation: enough for any x86_64 row (16 general
/// registers and the return address; a row with more rules is left to framehop).
pub(crate) struct Fixed;

impl UnwindContextStorage<usize> for Fixed {
    type Rules = [(addr2line::gimli::Register, RegisterRule<usize>); 24];
    type Stack = [UnwindTableRow<usize, Self>; 4];
}

const WAYS: usize = 2;
const SETS: usize = 1024;

#[derive(Clone, Copy)]
struct Entry {
    /// The lookup address (`ra - 1`); 0 for an empty entry.
    key: u64,
    rule: Rule,
}

const EMPTY: Entry = Entry {
    key: 0,
    rule: Rule::Other,
};

/// A two-way set-associative cache of compact rules keyed by lookup address, for one thread
/// (or one signal handler), with the evaluation context its misses use. Creating one
/// allocates; using one does not.
pub(crate) struct RuleCache {
    entries: Box<[[Entry; WAYS]; SETS]>,
    /// The image table the entries were derived from (its address).
    table: usize,
    ctx: Box<UnwindContext<usize, Fixed>>,
}

impl RuleCache {
    pub fn new() -> Self {
        RuleCache {
            entries: vec![[EMPTY; WAYS]; SETS]
                .into_boxed_slice()
                .try_into()
                .unwrap_or_else(|_| unreachable!("SETS entries")),
            table: 0,
            ctx: Box::new(UnwindContext::new_in()),
        }
    }

    /// Whether the entries were derived under `table` ([`RuleCache::rule`] makes them so).
    #[inline(always)]
    pub(crate) fn is_for(&self, table: &ImageTable) -> bool {
        self.table == table as *const ImageTable as usize
    }

    /// The cached rule for the lookup `addr` (`ra - 1`), if it is cached, under the table
    /// the entries were derived from (see [`RuleCache::is_for`]); never reads CFI. A hit in
    /// the second way moves it first, as in [`RuleCache::rule`].
    #[inline(always)]
    pub(crate) fn cached(&mut self, addr: u64) -> Option<Rule> {
        let set = &mut self.entries[set_of(addr)];
        if set[0].key == addr {
            return Some(set[0].rule);
        }
        if set[1].key == addr {
            set.swap(0, 1);
            return Some(set[0].rule);
        }
        None
    }

    /// The rule for the return-address lookup `addr` (`ra - 1`) under `table`.
    #[inline]
    pub fn rule(&mut self, table: &ImageTable, addr: u64) -> Rule {
        let id = table as *const ImageTable as usize;
        if self.table != id {
            // Entries of another table (a new cache's are empty already).
            if self.table != 0 {
                self.entries.fill([EMPTY; WAYS]);
            }
            self.table = id;
        }
        let set = &mut self.entries[set_of(addr)];
        if set[0].key == addr {
            return set[0].rule;
        }
        if set[1].key == addr {
            // Hot again: it moves to the first way, the other entry goes next.
            set.swap(0, 1);
            return set[0].rule;
        }
        let rule = derive(table, &mut self.ctx, addr);
        // The newest entry goes first; the older one moves to the second way.
        set[1] = set[0];
        set[0] = Entry { key: addr, rule };
        rule
    }
}

#[inline(always)]
fn set_of(addr: u64) -> usize {
    (addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SETS.trailing_zeros())) as usize
}

/// Reads the CFI row covering `addr` and reduces it.
#[cold]
fn derive(table: &ImageTable, ctx: &mut UnwindContext<usize, Fixed>, addr: u64) -> Rule {
    let Some(cfi) = table.cfi_for(addr) else {
        return Rule::Other;
    };
    let bases = BaseAddresses::default()
        .set_eh_frame_hdr(cfi.hdr_addr)
        .set_eh_frame(cfi.eh_addr)
        .set_text(cfi.text);
    let Ok(hdr) = EhFrameHdr::new(&cfi.hdr, LittleEndian).parse(&bases, 8) else {
        return Rule::Other;
    };
    let Some(search) = hdr.table() else {
        return Rule::Other;
    };
    let mut eh = EhFrame::new(&cfi.eh, LittleEndian);
    eh.set_address_size(8);
    // The search table gives the FDE's address; it must lie inside `.eh_frame` (a corrupted
    // table is not trusted with an offset computation).
    let fde_addr = match search.lookup(addr, &bases) {
        Ok(Pointer::Direct(p)) => p,
        _ => return Rule::Other,
    };
    let Some(offset) = fde_addr
        .checked_sub(cfi.eh_addr)
        .filter(|&o| o < cfi.eh.len() as u64)
    else {
        return Rule::Other;
    };
    let Ok(fde) = eh.fde_from_offset(
        &bases,
        EhFrameOffset(offset as usize),
        EhFrame::cie_from_offset,
    ) else {
        return Rule::Other;
    };
    if !fde.contains(addr) {
        return Rule::Other;
    }
    match fde.unwind_info_for_address(&eh, &bases, ctx, addr) {
        Ok(row) => compact(row.cfa(), row.register(dwarf::FP), row.register(dwarf::RA)),
        Err(_) => Rule::Other,
    }
}

/// The compact form of a CFI row, given its CFA rule and the rules for `rbp` and the return
/// address.
pub(crate) fn compact(
    cfa: &CfaRule<usize>,
    bp: Option<RegisterRule<usize>>,
    ra: Option<RegisterRule<usize>>,
) -> Rule {
    match ra {
        None | Some(RegisterRule::Undefined) => return Rule::End,
        Some(RegisterRule::Offset(-8)) => {}
        Some(_) => return Rule::Other,
    }
    let bp = match bp {
        None | Some(RegisterRule::Undefined) | Some(RegisterRule::SameValue) => None,
        Some(RegisterRule::Offset(o)) => Some(o),
        Some(_) => return Rule::Other,
    };
    match *cfa {
        CfaRule::RegisterAndOffset { register, offset } if register == dwarf::SP => {
            let Some(cfa8) = by8(offset).and_then(|v| u16::try_from(v).ok()) else {
                return Rule::Other;
            };
            let bp8 = match bp {
                None => 0,
                Some(o) => match by8(o).and_then(|v| i16::try_from(v).ok()) {
                    // framehop keeps the saved rbp's offset from the stack pointer in 16
                    // bits; a frame beyond that is left to its generic path, as framehop's.
                    Some(v) if v != 0 && i16::try_from(i64::from(cfa8) + i64::from(v)).is_ok() => v,
                    _ => return Rule::Other,
                },
            };
            if cfa8 == 0 {
                return Rule::Other;
            }
            Rule::Sp { cfa8, bp8 }
        }
        CfaRule::RegisterAndOffset { register, offset }
            if register == dwarf::FP && offset == 16 && bp == Some(-16) =>
        {
            Rule::Fp
        }
        _ => Rule::Other,
    }
}

fn by8(v: i64) -> Option<i64> {
    (v % 8 == 0).then_some(v / 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use addr2line::gimli::Register;

    const RA: Option<RegisterRule<usize>> = Some(RegisterRule::Offset(-8));

    fn sp(offset: i64) -> CfaRule<usize> {
        CfaRule::RegisterAndOffset {
            register: dwarf::SP,
            offset,
        }
    }

    #[test]
    fn rows_reduce_to_their_compact_rules() {
        // Function entry: CFA = rsp + 8.
        assert_eq!(compact(&sp(8), None, RA), Rule::Sp { cfa8: 1, bp8: 0 });
        // After `push rbp`: CFA = rsp + 16, rbp at CFA - 16.
        assert_eq!(
            compact(&sp(16), Some(RegisterRule::Offset(-16)), RA),
            Rule::Sp { cfa8: 2, bp8: -2 }
        );
        // After `mov rbp, rsp`.
        let fp = CfaRule::RegisterAndOffset {
            register: dwarf::FP,
            offset: 16,
        };
        assert_eq!(compact(&fp, Some(RegisterRule::Offset(-16)), RA), Rule::Fp);
        assert_eq!(
            compact(&sp(8), None, Some(RegisterRule::Undefined)),
            Rule::End
        );
        assert_eq!(compact(&sp(8), None, None), Rule::End);
    }

    #[test]
    fn rows_without_a_compact_form_are_left_to_framehop() {
        // Return address not at CFA - 8.
        assert_eq!(
            compact(&sp(16), None, Some(RegisterRule::Offset(-16))),
            Rule::Other
        );
        // rbp kept in another register, or at an odd offset.
        assert_eq!(
            compact(&sp(16), Some(RegisterRule::Register(Register(3))), RA),
            Rule::Other
        );
        assert_eq!(
            compact(&sp(16), Some(RegisterRule::Offset(-12)), RA),
            Rule::Other
        );
        // CFA from rbp at another offset (seen in libffi), from another register, unaligned.
        let odd = CfaRule::RegisterAndOffset {
            register: dwarf::FP,
            offset: 32,
        };
        assert_eq!(
            compact(&odd, Some(RegisterRule::Offset(-16)), RA),
            Rule::Other
        );
        let other_reg = CfaRule::RegisterAndOffset {
            register: Register(3),
            offset: 8,
        };
        assert_eq!(compact(&other_reg, None, RA), Rule::Other);
        assert_eq!(compact(&sp(12), None, RA), Rule::Other);
        assert_eq!(compact(&sp(0), None, RA), Rule::Other);
        assert_eq!(compact(&sp(8 << 20), None, RA), Rule::Other);
        // A frame so large that the saved rbp lies beyond 16 bits of words from rsp.
        assert_eq!(
            compact(&sp(40_000 * 8), Some(RegisterRule::Offset(-16)), RA),
            Rule::Other
        );
    }

    #[test]
    fn the_rules_of_this_binary_are_found_and_cached() {
        let table = crate::image::table();
        let mut cache = RuleCache::new();
        // A return address into this very function: its CFI (frame pointers are on) is the
        // frame record.
        let ra = here();
        assert_eq!(cache.rule(table, ra - 1), Rule::Fp);
        assert_eq!(cache.rule(table, ra - 1), Rule::Fp, "cached");
        // No code there at all.
        assert_eq!(cache.rule(table, 8), Rule::Other);
    }

    #[inline(never)]
    fn here() -> u64 {
        let r = crate::__fibertrace_registers_here!();
        // SAFETY: our own frame record: [fp + 8] is the return address into the caller.
        unsafe { std::ptr::read((r.fp + 8) as *const u64) }
    }
}
