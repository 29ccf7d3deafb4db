//! hybridcache-analyze: block traces in, workload signatures and recommended cache
//! configurations out (domain.md §10, the study's "query analyzer" done from device figures).
//!
//! Pipeline: [`parse_trace`] reads blkparse text (also hybridcache's own traces, whose pid field
//! is the NBD connection), SNIA/MSR Cambridge CSV or fio iologs v2/v3 into a [`Trace`], counting
//! and keeping the lines it could not parse; [`Signature::from_trace`] computes per job and for
//! the whole trace the read/write share, random vs sequential per direction, request sizes,
//! queue depth, throughput over time, working set and an LRU [`MissRatioCurve`] (exact, or
//! SHARDS-sampled for large traces); [`recommend`] turns a signature and a [`DeviceProfile`] (the
//! core's and the cache's speed per pattern) into a [`Recommendation`]: per job cache or bypass,
//! and one configuration (mode, cleaning, seq cutoff, promotion, IO classes, line size, cache
//! size) where every setting carries a one-sentence reason citing the figure it rests on;
//! [`Report`] renders it all as text or Markdown, and the recommendation renders itself as
//! `hybridcache` commands and a TOML config fragment.
//!
//! Boundaries: pure analysis. No dependency on the engine, volume, NBD or CLI crates: it never
//! touches a device, so it can run anywhere a trace can be copied to, and the CLI calls it. Its
//! own enums (cache mode, policies) mirror the Open CAS names the CLI accepts.
//!
//! ```
//! use hybridcache_analyze::*;
//! let text = "8,0 0 1 0.000000000 100 Q W 0 + 8 [fio]\n8,0 0 2 0.000100000 100 C W 0 + 8 [0]\n";
//! let trace = parse_trace(text.as_bytes(), Format::Auto).unwrap();
//! let sig = Signature::from_trace(&trace);
//! let rec = recommend(&sig, &DeviceProfile::raid60_study());
//! let report = Report::new(&trace, &sig, &rec, 1);
//! assert!(report.render_text().contains("write-back"));
//! ```

mod blkparse;
mod fio;
pub mod mrc;
mod msr;
pub mod profile;
pub mod recommend;
pub mod report;
pub mod series;
pub mod signature;
pub mod trace;
pub mod units;

pub use mrc::{MissRatioCurve, MrcBuilder, MrcOptions, MrcPoint, MRC_BLOCK};
pub use profile::{DeviceModel, DeviceProfile, Dir, Estimate, Pattern, PerfPoint, ProfileError};
pub use recommend::{
    config_params, fast_core, recommend, recommend_job, recommend_with, AcpParams, AlruParams,
    CacheConfig, CacheMode, Cleaning, Decision, IoClass, JobRecommendation, Offload, Promotion,
    ReadAhead, Reason, RecommendOptions, Recommendation, SeqCutoff, SeqCutoffPolicy,
};
pub use report::{Chart, Report, Section, Table};
pub use series::{time_series, JobSeries, TimeSeries};
pub use signature::{
    Bucket, DirStats, JobSignature, QueueDepth, Signature, SignatureOptions, Timeline, WorkingSet,
};
pub use trace::{
    detect_format, parse_trace, Action, BadLine, Event, Format, Op, ParseError, ParseReport, Rwbs,
    Trace,
};
