//! The request observer hook: what it is told, per connection, and when.

mod common;

use std::sync::Arc;

use common::*;
use hybridcache_nbd::{Client, Export, ObservedRequest, RequestKind, RequestObserver};
use parking_lot::Mutex;

#[derive(Default)]
struct Log {
    events: Mutex<Vec<(char, ObservedRequest)>>,
}

impl RequestObserver for Log {
    fn received(&self, req: &ObservedRequest) {
        self.events.lock().push(('Q', *req));
    }
    fn replied(&self, req: &ObservedRequest) {
        self.events.lock().push(('C', *req));
    }
}

#[test]
fn observer_sees_accepted_requests_per_connection() {
    let mem = MemExport::new(1 << 20).arc();
    let t = start(&[("disk", mem as Arc<dyn Export>)]);
    // Connected before the observer is attached: open connections must see it too.
    let mut a = Client::connect_unix(&t.sock, "disk").unwrap();
    let log = Arc::new(Log::default());
    assert!(t
        .server
        .registry()
        .set_observer("disk", Some(log.clone() as Arc<dyn RequestObserver>)));
    assert!(!t.server.registry().set_observer("nope", None));
    let mut b = Client::connect_unix(&t.sock, "disk").unwrap();

    a.write(&[7u8; 8192], 4096, true).unwrap();
    let mut buf = [0u8; 4096];
    b.read(&mut buf, 0).unwrap();
    a.flush().unwrap();
    b.trim(0, 4096).ok();
    // Rejected before reaching the export: not observed.
    assert!(a.read(&mut buf, 1 << 20).is_err());

    let events = log.events.lock().clone();
    let kinds: Vec<(char, RequestKind)> = events.iter().map(|(c, r)| (*c, r.kind)).collect();
    assert_eq!(
        kinds[..6],
        [
            ('Q', RequestKind::Write),
            ('C', RequestKind::Write),
            ('Q', RequestKind::Read),
            ('C', RequestKind::Read),
            ('Q', RequestKind::Flush),
            ('C', RequestKind::Flush),
        ]
    );
    let (_, w) = events[0];
    assert_eq!((w.offset, w.len, w.fua), (4096, 8192, true));
    let (_, r) = events[2];
    assert_eq!((r.offset, r.len), (0, 4096));
    assert_ne!(w.connection, r.connection, "connections get their own ids");
    assert_eq!(events[4].1.connection, w.connection);
    // Each completion names the same request as its queue event, later.
    let (q, c) = (events[0].1, events[1].1);
    assert_eq!((q.handle, q.connection), (c.handle, c.connection));
    assert!(c.time >= q.time);

    // Detached: nothing more is recorded.
    t.server.registry().set_observer("disk", None);
    let n = log.events.lock().len();
    a.read(&mut buf, 0).unwrap();
    assert_eq!(log.events.lock().len(), n);
    a.disconnect().unwrap();
    b.disconnect().unwrap();
}
