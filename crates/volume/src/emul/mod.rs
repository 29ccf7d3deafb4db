//! Emulated slow devices, so fio and the cache can be run against an HDD or an HDD RAID without
//! owning one: [`ThrottledVolume`] (latency, IOPS and bandwidth caps around another volume),
//! [`EmulatedVolume`] (a model of a hard disk or of a RAID 0/1/10/5/6/50/60 array of them) and
//! [`SsdVolume`] (a flash SSD, or an SSD array behind a RAID controller, by its parallelism,
//! IOPS, bandwidth and latency).
//!
//! Job: make requests take the time the modelled device would take — the calling thread really
//! sleeps until the modelled completion, several threads can be in flight against one device, and
//! the model queues them on its actuators — while keeping the data (in RAM, a sparse file, or
//! nowhere with `nodata`) so verification works.
//!
//! Boundaries: timing models only, no fidelity to any vendor's firmware. The disk model
//! ([`hdd`](HddConfig)) has seek (settle + sqrt of distance), rotation and transfer, one actuator
//! and optional NCQ reordering; the array model ([`RaidConfig`]) has read-modify-write, full-stripe
//! writes, a merge window, a stripe cache holding parity back, and a parity engine; it does not
//! model degraded arrays, rebuilds, disks' own write caches, or a controller write-back cache
//! for data. Time comes from a
//! [`Clock`], so tests run the same models on a [`VirtualClock`] without sleeping, and
//! [`simulate`] computes closed-loop throughput for calibration (see [`calibration_cells`]).
//!
//! Calibration target: [`RaidConfig::study_raid60`] against the no-cache baselines of the
//! project's domain notes (§10): a RAID 60 of 4 x 10 disks, 7200 rpm, 64 KiB strips.

mod clock;
mod device;
mod hdd;
mod raid;
mod sim;
mod ssd;
mod throttle;

pub use clock::{nanos, Clock, ClockRef, Nanos, RealClock, VirtualClock};
pub use device::{Backing, EmulConfig, EmulatedVolume};
pub use hdd::{HddConfig, STARVATION_LIMIT};
pub use raid::{IoKind, ParityEngine, RaidConfig, RaidLevel};
pub use sim::{
    calibration_cells, calibration_cells_through, calibration_table, measured, simulate,
    simulate_study_job, simulate_study_job_through, study_cells, Cell, Measure, Pattern, SimResult,
    SplitMix64, StudyCell, StudyJob, Transport, Workload, STUDY_DEPTHS, STUDY_MIXED_5050_IOPS,
    STUDY_MIXED_QD32_IOPS, STUDY_RANDOM_WRITE_IOPS, STUDY_SEQ_WRITE_MBS, STUDY_SPAN,
};
pub use ssd::{SsdConfig, SsdVolume};
pub use throttle::{ThrottleConfig, ThrottledVolume};
