//! Request observation: an optional hook per export, told about every request the server
//! accepts when it is received and again when it finished, just before its reply is queued.
//!
//! It exists for tracing (`hybridcache trace`): a block trace needs the time a request entered
//! the system, which only the transport knows. Stamping it where a worker starts executing the
//! request would cap the apparent queue depth at the worker count, so the receive hook runs as
//! soon as the request header is parsed and validated, before a write's payload is read.
//!
//! Receipt time: a request may sit in the connection's read buffer while the one before it runs
//! inline, so the time the server parses it is not when it arrived. The received hook therefore
//! carries the time of the socket read that brought the request in; events are thus not
//! delivered in time order, and an observer that needs order must sort (the tracer does).
//!
//! Cost when nobody observes: one relaxed atomic load per request on each side. Observers are
//! called on the connection's worker threads, inline with the data path, so they must only
//! record and return (buffer the event, write it elsewhere). Rejected requests (invalid
//! commands, out of range) never reach the export and are not observed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

use crate::transmission::Job;

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Read,
    Write,
    Flush,
    /// `NBD_CMD_TRIM` (discard).
    Trim,
    WriteZeroes,
    /// `NBD_CMD_CACHE` (prefetch hint).
    Cache,
}

/// One accepted request as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObservedRequest {
    /// Identifies the client connection; unique within the process, counting from 1.
    pub connection: u64,
    /// The client's handle (cookie) for the request.
    pub handle: u64,
    pub kind: RequestKind,
    /// Byte range as the client sent it (0/0 for a flush).
    pub offset: u64,
    pub len: u32,
    /// Forced unit access requested.
    pub fua: bool,
    /// For `received`: when the request's header came in from the socket (the read that
    /// brought it; pipelined requests read in one go share it, as they were waiting together).
    /// For `replied`: now.
    pub time: Instant,
}

/// Told about every accepted request of the export it is attached to.
pub trait RequestObserver: Send + Sync {
    /// The request was received (header parsed and validated).
    fn received(&self, req: &ObservedRequest);
    /// The request finished; called just before its reply (success or error) is queued, so a
    /// client's next request is never observed before this completion.
    fn replied(&self, req: &ObservedRequest);
}

/// The observer slot of one export. Connections hold the export entry, so an observer
/// attached later is seen by connections already open.
#[derive(Default)]
pub(crate) struct ObserverSlot {
    /// Mirrors `observer.is_some()`, so the unobserved path takes no lock.
    active: AtomicBool,
    observer: RwLock<Option<Arc<dyn RequestObserver>>>,
}

impl ObserverSlot {
    pub(crate) fn set(&self, observer: Option<Arc<dyn RequestObserver>>) {
        let mut o = self.observer.write();
        self.active.store(observer.is_some(), Ordering::Release);
        *o = observer;
    }

    pub(crate) fn get(&self) -> Option<Arc<dyn RequestObserver>> {
        if !self.active.load(Ordering::Relaxed) {
            return None;
        }
        self.observer.read().clone()
    }
}

/// A new connection id.
pub(crate) fn next_connection_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn observed(connection: u64, handle: u64, job: &Job, time: Instant) -> ObservedRequest {
    let (kind, offset, len, fua) = match *job {
        Job::Read { offset, len } => (RequestKind::Read, offset, len, false),
        Job::Write { offset, len, fua } => (RequestKind::Write, offset, len, fua),
        Job::Flush => (RequestKind::Flush, 0, 0, false),
        Job::Trim { offset, len, fua } => (RequestKind::Trim, offset, len, fua),
        Job::WriteZeroes {
            offset, len, fua, ..
        } => (RequestKind::WriteZeroes, offset, len, fua),
        Job::Cache { offset, len } => (RequestKind::Cache, offset, len, false),
    };
    ObservedRequest {
        connection,
        handle,
        kind,
        offset,
        len,
        fua,
        time,
    }
}
