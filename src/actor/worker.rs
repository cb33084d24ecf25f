//! Worker processes (filled in by the process-actor work).
use crate::error::{Error, Result};
use crate::value::Value;

pub(crate) struct ProcessLink {
    pid: u32,
}

impl ProcessLink {
    pub(crate) fn spawn(_id: u64, name: &str, _type_name: &str, _init: Vec<u8>) -> Result<Self> {
        Err(Error::Spawn {
            actor: name.to_string(),
            message: "process actors are not available yet".into(),
        })
    }

    pub(crate) fn call<Args: Value, R: Value>(&self, actor: &str, method: &str, _args: Args) -> Result<R> {
        Err(Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message: "process actors are not available yet".into(),
        })
    }

    pub(crate) fn install(
        &self,
        _plan: std::sync::Arc<crate::compile::plan::GraphPlan>,
        _chans: &crate::channel::endpoint::ProcChannels,
        _installed: crossbeam_channel::Sender<Result<(), String>>,
        _done: crossbeam_channel::Sender<String>,
    ) -> Result<()> {
        Ok(())
    }

    pub(crate) fn kill(&self) -> Result<()> {
        Ok(())
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}

pub(crate) fn maybe_run_worker() {}
