//! The CRC32C of two byte strings joined, from their own CRCs and the second's length, in
//! time logarithmic in the length and with no table built per call.
//!
//! A CRC is the message, as a polynomial over GF(2), times x^32 modulo the CRC polynomial
//! (with the pre- and post-inversion, which cancel out of a join). So the CRC of A ‖ B is
//! the CRC of A shifted by B's length (multiplied by x^(8·len(B)) modulo the polynomial)
//! added to B's. `crc32c::crc32c_combine` builds that shift from 32×32 bit matrices squared
//! once per bit of the length on every call, tens of microseconds for a large entry; here the
//! powers x^(2^k) are constants made at compile time and a shift is one multiplication (32
//! bit steps) per set bit of the length.
//!
//! Polynomials are in the CRC's reflected form: bit 31 is the coefficient of x^0, bit 0 that
//! of x^31.

/// x^32 modulo the CRC32C (Castagnoli) polynomial, reflected.
const POLY: u32 = 0x82F6_3B78;

/// The polynomial 1 (x^0), reflected.
const ONE: u32 = 1 << 31;

/// `a · b` modulo the polynomial.
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    // `b` is multiplied by x once per coefficient of `a`, from x^0 up.
    let mut bit = ONE;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// `POWERS[k]` is x^(2^k) modulo the polynomial; bit `i` of a length in bytes is 2^(i+3) bits.
const POWERS: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = ONE >> 1; // x^1
    let mut k = 1;
    while k < 67 {
        t[k] = multiply(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// x^(8·bytes) modulo the polynomial: the shift past `bytes` bytes.
fn shift_for(bytes: usize) -> u32 {
    let mut rest = bytes as u64;
    let mut power = ONE;
    // One byte is x^8 = x^(2^3).
    let mut k = 3;
    while rest != 0 {
        if rest & 1 != 0 {
            power = multiply(power, POWERS[k]);
        }
        rest >>= 1;
        k += 1;
    }
    power
}

/// The CRC32C of `a ‖ b`, given `crc_a` of `a`, `crc_b` of `b` and `b`'s length.
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    multiply(shift_for(len_b), crc_a) ^ crc_b
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    #[test]
    fn given_two_byte_strings_then_their_crcs_combine_to_the_crc_of_both() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(20261203);
        let mut lens: Vec<usize> = vec![0, 1, 2, 3, 7, 8, 63, 64, 1024, 65_536, 131_072, 4 << 20];
        lens.extend((0..200).map(|_| rng.gen_range(0..300_000)));
        for (i, &len_b) in lens.iter().enumerate() {
            let mut a = vec![0u8; rng.gen_range(0..5000) + i % 3];
            let mut b = vec![0u8; len_b];
            rng.fill_bytes(&mut a);
            rng.fill_bytes(&mut b);
            let whole = crc32c::crc32c(&[a.as_slice(), b.as_slice()].concat());
            let (ca, cb) = (crc32c::crc32c(&a), crc32c::crc32c(&b));
            assert_eq!(crc32c_combine(ca, cb, b.len()), whole, "len_b {len_b}");
            assert_eq!(crc32c::crc32c_combine(ca, cb, b.len()), whole);
        }
    }

    #[test]
    fn the_powers_are_the_squares_of_x() {
        // x^1, x^2, x^4, x^8, x^16 have one coefficient set; x^32 is the polynomial itself.
        for (k, power) in POWERS.iter().take(5).enumerate() {
            assert_eq!(*power, ONE >> (1 << k));
        }
        assert_eq!(POWERS[5], POLY);
    }
}
