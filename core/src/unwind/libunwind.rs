//! libunwind oracle
