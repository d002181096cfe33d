//! `--memory file:PATH | blk:DEVICE`: WRITE (or READ) between host (or GPU,
//! `--src-memory vram`) memory
//! and the agent's own storage (or, `--storage-peer`, a peer agent's, through
//! that agent over TCP), the plan's block sizes and batches, in the same
//! table as the other runs. `--memory obj:BUCKET[/PREFIX]`: the same with
//! objects in an S3 store, one per descriptor.

use anyhow::{Context, Result, bail};
use kvxfer::storage::obj::ObjectStoreConfig;
use kvxfer::{
    Backend, MemoryDesc, MemoryDescs, MemoryType, StorageIo, StorageSpec, TransferAgent,
    make_transfer_agent,
};

use crate::{Args, Mem, Target, config, plan, run_points};

/// Runs the plan against the storage `memory` names.
pub fn run(args: &Args, memory: &str) -> Result<()> {
    if let Some(("obj", spec)) = memory.split_once(':') {
        return run_obj(args, spec);
    }
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
        objects: None,
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

/// `--memory obj:BUCKET[/PREFIX]`: the plan's points against `--batch`
/// objects of the agent's own, `PREFIX/<i>` (default prefix
/// `kvxfer-bench`), in the store the environment names.
fn run_obj(args: &Args, spec: &str) -> Result<()> {
    if args.storage_peer {
        bail!("--storage-peer: a peer's objects are not reached through it (OBJ is local)");
    }
    let (bucket, prefix) = spec.split_once('/').unwrap_or((spec, "kvxfer-bench"));
    let points = plan(args);
    let objects = points.iter().map(|p| p.batch).max().unwrap_or(0);
    let largest = points.iter().map(|p| p.block).max().unwrap_or(0);
    let need = points.iter().map(|p| p.block * p.batch).max().unwrap_or(0);
    let store = ObjectStoreConfig::from_env(bucket)
        .and_then(ObjectStoreConfig::build)
        .context("the object store (AWS_ENDPOINT_URL, AWS credentials)")?;
    let agent = make_transfer_agent(Backend::Tcp, config("kvxfer-bench-obj", args))?;
    let src = Mem::new(args.src_kind(), need, args.gpu)?;
    // SAFETY: `src` outlives the agent (dropped first, below) and is only
    // touched by transfers.
    unsafe { agent.register_memory(&src.desc())? };
    let mut handles = Vec::with_capacity(objects as usize);
    for i in 0..objects {
        let key = format!("{prefix}/{i}");
        let h = agent
            .open_object(&store, &key)
            .with_context(|| format!("opening object {key}"))?;
        let region = MemoryDescs::new(MemoryType::Obj, vec![MemoryDesc::new(0, largest, h)]);
        // SAFETY: a range of an object, not memory.
        unsafe { agent.register_memory(&region) }
            .with_context(|| format!("registering object {key}"))?;
        handles.push(h);
    }
    let target = Target {
        remote: agent.name().to_owned(),
        mem_type: MemoryType::Obj,
        base: 0,
        device_id: 0,
        objects: Some(handles),
    };
    run_points(args, agent.as_ref(), &target, &src, &points)?;
    drop(agent);
    Ok(())
}
