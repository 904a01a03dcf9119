//! The shared-memory ring and control segment of the DatasetRT loader.
//!
//! The loader is being built (issue #4); this crate is part of the workspace so the layout
//! stays as DESIGN.md describes it.
