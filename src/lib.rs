//! flatpipe
