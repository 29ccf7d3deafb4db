//! `hybridcache config export [-o PATH]`: the running setup written as a configuration file
//! where the operator says (or to stdout). `hybridcache config import [PATH|-]`: Open CAS's
//! opencas.conf converted to this configuration (hybridcache_daemon::opencas_conf). The daemon never writes a file of the operator's on
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
    /// Convert Open CAS's opencas.conf to the equivalent hybridcache configuration, written to
    /// stdout, with a comment on everything that could not be carried over and why. The
    /// daemon also reads an opencas.conf given to --config as it is.
    Import {
        /// The opencas.conf to read, `-` for stdin.
        #[arg(value_name = "PATH|-", default_value = DEFAULT_OPENCAS_CONF)]
        path: String,
    },
}

/// Where Open CAS keeps it (`cas_config.default_location` in utils/opencas.py).
const DEFAULT_OPENCAS_CONF: &str = "/etc/opencas/opencas.conf";

fn import(path: &str) -> Result<()> {
    let (text, source) = if path == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("cannot read opencas.conf from stdin")?;
        (text, "stdin".to_string())
    } else {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {path}"))
            .map_err(|e| anyhow!("{e:#}"))?;
        (text, path.to_string())
    };
    let conf = hybridcache_daemon::opencas_conf::OpenCasConf::parse(&text)
        .map_err(|e| anyhow!("{source}: {e:#}"))?;
    print!("{}", conf.to_toml(&source)?);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Exported {
    toml: String,
}

pub fn run(args: &ConfigArgs, control: &Path) -> Result<()> {
    match &args.cmd {
        ConfigCmd::Import { path } => import(path),
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
