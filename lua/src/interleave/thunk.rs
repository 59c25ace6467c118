//! Tail-jump thunks: C functions whose whole body sets up arguments and jumps to another
//! function, leaving no frame of their own. LuaJIT's `pairs` and `ipairs` fallbacks
//! (`lj_ffh_pairs`: `mov $MM_pairs, %esi; jmp ffh_pairs`, and `getmetatable`, which recycles
//! `ipairs`'s) are such thunks once compiled, and so is any `lua_CFunction` written
//! `return helper(L, 1);`. A C level named by the thunk's address runs in the target's frame:
//! the merge anchors it there too ([`super::classify::VmMap::tail_target`]).
//!
//! Only the two shapes compilers emit for such a body are recognised, per architecture (the
//! one leaf of this module that knows instruction encodings): up to three register moves of
//! an immediate (or a register cleared), then an unconditional jump. Anything else is not a
//! thunk; a thunk not recognised leaves its C level unanchored, as before (the level then
//! goes with the Lua run after it: see the module doc of [`super`]).

use object::Architecture;

/// The offset from the start of `code` (a function's bytes) of the function it tail-jumps
/// to, if `code` is a thunk of `arch`.
pub fn tail_jump(arch: Architecture, code: &[u8]) -> Option<i64> {
    match arch {
        Architecture::X86_64 => x86_64(code),
        Architecture::Aarch64 => aarch64(code),
        _ => None,
    }
}

/// x86-64: `mov $imm32, %r32` (`b8+r`, or `41 b8+r` for `%r8d`-`%r15d`), `xor %r32, %r32`
/// (`31`/`33` with a register-to-itself operand, optionally `45`-prefixed), then `jmp rel32`
/// (`e9`) or `jmp rel8` (`eb`).
fn x86_64(code: &[u8]) -> Option<i64> {
    let mut at = 0;
    for _ in 0..=3 {
        let rest = code.get(at..)?;
        match rest {
            [0xe9, a, b, c, d, ..] => {
                return Some((at + 5) as i64 + i64::from(i32::from_le_bytes([*a, *b, *c, *d])));
            }
            [0xeb, r, ..] => return Some((at + 2) as i64 + i64::from(*r as i8)),
            [0xb8..=0xbf, ..] => at += 5,
            [0x41, 0xb8..=0xbf, ..] => at += 6,
            [0x31 | 0x33, m, ..] if same_register(*m) => at += 2,
            [0x45, 0x31 | 0x33, m, ..] if same_register(*m) => at += 3,
            _ => return None,
        }
    }
    None
}

/// Whether ModRM byte `m` names one register as both operands.
fn same_register(m: u8) -> bool {
    m >> 6 == 3 && (m >> 3) & 7 == m & 7
}

/// AArch64: `movz`/`movn` of a `w` or `x` register, or `mov` between registers (`orr` with
/// the zero register), then `b imm26`.
fn aarch64(code: &[u8]) -> Option<i64> {
    for (k, w) in code.chunks_exact(4).take(4).enumerate() {
        let insn = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        if insn & 0xfc00_0000 == 0x1400_0000 {
            // `b`: a signed 26-bit word offset.
            let words = ((insn << 6) as i32) >> 6;
            return Some((k * 4) as i64 + i64::from(words) * 4);
        }
        let movz_movn = insn & 0x7f80_0000 == 0x5280_0000 || insn & 0x7f80_0000 == 0x1280_0000;
        let mov_reg = insn & 0x7fe0_ffe0 == 0x2a00_03e0;
        if !(movz_movn || mov_reg) {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x86_64_thunks_are_found_and_other_code_is_not() {
        // lj_ffh_pairs: mov $0x14, %esi; jmp -0xe5 (to ffh_pairs).
        let pairs = [0xbe, 0x14, 0, 0, 0, 0xe9, 0x16, 0xff, 0xff, 0xff, 0xcc];
        assert_eq!(tail_jump(Architecture::X86_64, &pairs), Some(10 - 0xea));
        assert_eq!(tail_jump(Architecture::X86_64, &[0xeb, 0x10]), Some(0x12));
        // xor %eax, %eax; mov $1, %r9d; jmp +0
        let xor_r9 = [0x31, 0xc0, 0x41, 0xb9, 1, 0, 0, 0, 0xe9, 0, 0, 0, 0];
        assert_eq!(tail_jump(Architecture::X86_64, &xor_r9), Some(13));
        // A frame (push %rbx) first; xor of two registers; a call; four moves; truncated.
        for code in [
            &[0x53, 0xe9, 0, 0, 0, 0][..],
            &[0x31, 0xc8, 0xe9, 0, 0, 0, 0],
            &[0xe8, 0, 0, 0, 0, 0xc3],
            &[
                0xb8, 0, 0, 0, 0, 0xb8, 0, 0, 0, 0, 0xb8, 0, 0, 0, 0, 0xb8, 0, 0, 0, 0, 0xeb, 0,
            ],
            &[0xbe, 0x14, 0, 0, 0, 0xe9, 0x16, 0xff],
            &[],
        ] {
            assert_eq!(tail_jump(Architecture::X86_64, code), None, "{code:x?}");
        }
        assert_eq!(tail_jump(Architecture::Riscv64, &pairs), None);
    }

    #[test]
    fn aarch64_thunks_are_found_and_other_code_is_not() {
        let le = |w: &[u32]| w.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>();
        // mov w1, #0x14; b -0x40
        let code = le(&[0x5280_0281, 0x1400_0000 | (0x3ff_fff0 & 0x03ff_ffff)]);
        assert_eq!(tail_jump(Architecture::Aarch64, &code), Some(4 - 0x40));
        // mov x2, x0; b +8
        assert_eq!(
            tail_jump(Architecture::Aarch64, &le(&[0xaa00_03e2, 0x1400_0002])),
            Some(12)
        );
        // stp x29, x30, [sp, #-16]! first: a frame.
        assert_eq!(
            tail_jump(Architecture::Aarch64, &le(&[0xa9bf_7bfd, 0x1400_0002])),
            None
        );
    }
}
