//! libgpufrac.so
