//! Socket helpers shared by the engine's control plane and the TCP backend: admission
//! caps for unauthenticated connections, and reads and writes bounded by one deadline.

pub(crate) mod admission;
pub(crate) mod deadline;
pub(crate) mod frame;
