//! `--memory file:PATH | blk:DEVICE`: WRITE (or READ) between host (or GPU,
//! `--src-memory vram`) memory
//! and the agent's own storage (or, `--storage-peer`, a peer agent's, through
//! that agent over TCP), the plan's block sizes and batches, in the same
//! table as the other runs.

use anyhow::{Context, Result, bail};
use kvxfer::{
    Backend, MemoryDesc, MemoryDescs, MemoryType, StorageIo, StorageSpec, TransferAgent,
    make_transfer_agent,
};

use crate::{Args, Mem, Target, config, plan, run_points};

/// Runs the plan against the storage `memory` names.
pub fn run(args: &Args, memory: &str) -> Result<()> {
    let points = plan(args);
    let need = points.iter().map(|p| p.block * p.batch).max().unwrap_or(0);
    let io: StorageIo = args.storage_io.parse()?;
    let spec = match memory.split_once(':') {
        Some(("file", path)) => StorageSpec::file(path).create(need).direct(!args.buffered),
        Some(("blk", path)) => StorageSpec::block(path),
        _ => bail!("--memory takes file:PATH or blk:DEVICE, not {memory:?}"),
    };
    let cfg = config("kvxfer-bench-storage", args).with_storage_io(io);
    let agent = make_transfer_agent(Backend::Tcp, cfg)?;
    let src = Mem::new(args.src_kind(), need, args.gpu)?;
    // SAFETY: `src` outlives the agent (dropped first, below) and is only
    // touched by transfers.
    unsafe { agent.register_memory(&src.desc())? };
    // The agent whose storage it is: this one, or a peer.
    let peer = if args.storage_peer {
        let cfg = config("kvxfer-bench-storage-peer", args).with_storage_io(io);
        Some(make_transfer_agent(Backend::Tcp, cfg)?)
    } else {
        None
    };
    let owner = peer.as_deref().unwrap_or(agent.as_ref());
    let handle = owner
        .open_storage(&spec)
        .with_context(|| format!("opening {memory}"))?;
    let mem_type = spec.kind.mem_type();
    let region = MemoryDescs::new(mem_type, vec![MemoryDesc::new(0, need, handle)]);
    // SAFETY: a storage range (file offsets), not memory.
    unsafe { owner.register_memory(&region) }
        .with_context(|| format!("registering the first {need} bytes of {memory}"))?;
    if peer.is_some() {
        agent.load_remote_agent(&owner.local_agent_desc())?;
    }
    let target = Target {
        remote: owner.name().to_owned(),
        mem_type,
        base: 0,
        device_id: handle,
    };
    if mem_type == MemoryType::File && !args.json {
        eprintln!(
            "{memory}: {}",
            if args.buffered {
                "through the page cache"
            } else {
                "O_DIRECT"
            }
        );
    }
    run_points(
        args,
        agent.as_ref() as &dyn TransferAgent,
        &target,
        &src,
        &points,
    )?;
    drop(agent);
    drop(peer);
    Ok(())
}
