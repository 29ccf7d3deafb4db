//! `hybridcache config export [-o PATH]`: the running setup written as a configuration file
//! where the operator says (or to stdout). The daemon never writes a file of the operator's on
//! its own (docs/cli.md, "State directory"); this is the explicit way to keep the run-time
//! setup in one.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::{Args, Subcommand};

use crate::protocol::Request;

#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub cmd: ConfigCmd,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCmd {
    /// Write the running setup (caches, cores, parameters, the [daemon] section of the file
    /// the daemon was started with) as a configuration file.
    Export {
        /// Write it to this file (replaced atomically) [default: stdout].
        #[arg(short = 'o', long = "output", value_name = "PATH")]
        output: Option<PathBuf>,
    },
}

#[derive(serde::Deserialize)]
struct Exported {
    toml: String,
}

pub fn run(args: &ConfigArgs, control: &Path) -> Result<()> {
    match &args.cmd {
        ConfigCmd::Export { output } => {
            let exported: Exported = crate::call(control, &Request::ExportConfig)?;
            let text = format!(
                "# The running setup of hybridcache, written by `hybridcache config export`.\n{}",
                exported.toml
            );
            match output {
                None => print!("{text}"),
                Some(path) => {
                    hybridcache_daemon::state::write_atomic(path, text.as_bytes())
                        .with_context(|| format!("cannot write {}", path.display()))
                        .map_err(|e| anyhow!("{e:#}"))?;
                    println!("wrote the running setup to {}", path.display());
                }
            }
            Ok(())
        }
    }
}
