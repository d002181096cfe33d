//! Backend-independent agent state: local registrations (with access keys
//! and in-flight counters).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::desc::{ExportedRegion, RegionKey};
use crate::error::{Error, RejectReason};
use crate::memory::{MemoryDesc, MemoryDescs, MemoryType, RegionMap};
use crate::pool::Share;
use crate::small::Few;

/// One local registration.
#[derive(Debug)]
pub(crate) struct LocalRegion {
    pub(crate) key: u64,
    /// The registered range.
    pub(crate) desc: MemoryDesc,
    /// Host memory used with storage: its slot in the io_uring ring's
    /// registered buffers (`None`: tried, plain reads and writes), taken on
    /// first use and given back on deregistration.
    pub(crate) storage_slot: std::sync::OnceLock<Option<u16>>,
    busy: AtomicUsize,
    /// Its registrations with the agent's transports that register memory
    /// (each named by its transport), dropped (deregistered) with it.
    handles: Few<(&'static str, Box<dyn RegionHandle>)>,
    /// GPU memory: where it sits in its allocation, and the allocation's
    /// IPC handle.
    pub(crate) gpu: Option<GpuRegion>,
    /// A shared pool ([`crate::pool`]): the file same-host peers may map.
    pub(crate) share: Option<Share>,
}

/// What a VRAM region keeps of its allocation.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct GpuRegion {
    /// The device it is on.
    pub(crate) device: u32,
    /// The allocation's base address.
    pub(crate) base: u64,
    /// The region's start minus the allocation's base.
    pub(crate) offset: u64,
    /// The allocation's legacy IPC handle, when the driver gave one.
    pub(crate) ipc: Option<[u8; 64]>,
    /// A VMM allocation's descriptor handle (no legacy handle exists for
    /// one), when its creator made it shareable so.
    pub(crate) vmm: Option<Arc<VmmShare>>,
}

/// A VMM allocation shareable through a POSIX file descriptor: given to a
/// proven same-host peer on the shm transport's channel, which imports and
/// maps it whole.
#[derive(Debug)]
pub(crate) struct VmmShare {
    /// The descriptor (`cuMemExportToShareableHandle`).
    pub(crate) fd: std::os::fd::OwnedFd,
    /// The allocation's size: what the importer maps.
    pub(crate) size: u64,
}

/// How a same-host peer opens a VRAM region's allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpuHandle {
    /// A legacy IPC handle, carried in the descriptor.
    Ipc([u8; 64]),
    /// A VMM allocation of this size, whose descriptor the peer asks for.
    Vmm(u64),
}

impl LocalRegion {
    /// Its registration with transport `name`, if that transport made one.
    pub(crate) fn handle(&self, name: &str) -> Option<&dyn RegionHandle> {
        self.handles
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, h)| &**h)
    }
}

/// A transport's registration of one region with its device, made when the
/// region is registered and dropped (deregistered) with it.
pub(crate) trait RegionHandle: Send + Sync + std::fmt::Debug {
    /// What the transport's own operations on the region carry (an RDMA
    /// local key, a libfabric memory descriptor).
    fn local_key(&self) -> u64;

    /// What a peer presents to reach the region, as the agent's descriptor
    /// carries it (integers little-endian, of the transport's width), given
    /// the region's access key (the descriptor's `key`), which a transport
    /// that seals its keys in descriptors derives each seal from (the
    /// libfabric transport's; see `engine::fabric`).
    fn remote_key(&self, access: u64) -> Vec<u8>;
}

/// A transport that registers regions with its device.
pub(crate) trait Registrar: Send + Sync {
    /// The transport's name: the one its offer in the descriptor has.
    fn name(&self) -> &'static str;

    /// Registers `desc` (memory of `mem_type`; `gpu`: where GPU memory
    /// lies in its allocation). `Ok(None)`: the transport leaves such memory
    /// unregistered (it does not move it, or cannot here and says so when
    /// it is asked to move it).
    ///
    /// # Errors
    /// Why the device refused it; nothing is then registered.
    ///
    /// # Safety
    /// The range must stay allocated while registered (the device may
    /// access it).
    unsafe fn register(
        &self,
        mem_type: MemoryType,
        desc: &MemoryDesc,
        gpu: Option<&GpuRegion>,
    ) -> Result<Option<Box<dyn RegionHandle>>, Error>;
}

/// Holds a region in use; deregistration is refused while any guard lives.
#[derive(Debug)]
pub(crate) struct RegionGuard(Arc<LocalRegion>);

impl RegionGuard {
    /// A new hold on `region` (sequentially consistent: see
    /// [`Registry::hold_current`]).
    fn new(region: &Arc<LocalRegion>) -> Self {
        region.busy.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(region))
    }

    /// The region held.
    pub(crate) fn region(&self) -> &Arc<LocalRegion> {
        &self.0
    }
}

impl Clone for RegionGuard {
    /// Another hold on the same region.
    fn clone(&self) -> Self {
        Self::new(&self.0)
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Local registrations of one agent.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    map: RwLock<RegionMap<Arc<LocalRegion>>>,
    /// Bumped by every deregistration, before it checks the regions are
    /// idle: a holder of regions resolved at an older generation must
    /// resolve them again (see [`Registry::hold_current`]).
    generation: AtomicU64,
}

impl Registry {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, RegionMap<Arc<LocalRegion>>> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, RegionMap<Arc<LocalRegion>>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers all of `descs` or none, with each of `registrars`.
    ///
    /// # Safety
    /// Every range must stay allocated while registered (a registrar's
    /// device may access it); see `TransferAgent::register_memory`.
    pub(crate) unsafe fn register(
        &self,
        descs: &MemoryDescs,
        supported: &[MemoryType],
        backend: &'static str,
        registrars: &[&dyn Registrar],
        gpu: &[GpuRegion],
        share: Option<&Share>,
    ) -> Result<(), Error> {
        if !supported.contains(&descs.mem_type) {
            return Err(Error::UnsupportedMemoryType {
                mem_type: descs.mem_type,
                backend,
            });
        }
        let mut map = self.write();
        // Validate against existing registrations and among themselves
        // before touching the map.
        let mut batch = RegionMap::new();
        for d in &descs.descs {
            map.check_insert(descs.mem_type, d)?;
            batch.insert(descs.mem_type, *d, ())?;
        }
        // Device registrations first: if one fails, the ones made so far are
        // dropped (deregistered) and nothing was inserted.
        let mut handles = Vec::with_capacity(descs.descs.len());
        for (i, d) in descs.descs.iter().enumerate() {
            let mut hs = Few::new();
            for r in registrars {
                // SAFETY: the caller guarantees the range stays allocated
                // while registered; the handle is dropped with the region.
                if let Some(h) = unsafe { r.register(descs.mem_type, d, gpu.get(i)) }? {
                    hs.push((r.name(), h));
                }
            }
            handles.push(hs);
        }
        for (i, (d, handles)) in descs.descs.iter().zip(handles).enumerate() {
            let region = Arc::new(LocalRegion {
                key: crate::pool::access_key(crate::auth::random_u64(), share.is_some()),
                desc: *d,
                storage_slot: std::sync::OnceLock::new(),
                busy: AtomicUsize::new(0),
                handles,
                gpu: gpu.get(i).cloned(),
                share: share.cloned(),
            });
            map.insert(descs.mem_type, *d, region)
                .expect("checked above under the same lock");
        }
        Ok(())
    }

    /// Deregisters all of `descs` or none; the regions removed.
    pub(crate) fn deregister(&self, descs: &MemoryDescs) -> Result<Vec<Arc<LocalRegion>>, Error> {
        let mut map = self.write();
        // Before the idle checks (sequentially consistent, as in
        // `hold_current`): a hold taken on a cached region either shows in
        // `busy` below or sees this bump and is given back.
        self.generation.fetch_add(1, Ordering::SeqCst);
        for d in &descs.descs {
            let Some(r) = map.get_exact(descs.mem_type, d) else {
                return Err(Error::NotARegistration {
                    mem_type: descs.mem_type,
                    desc: *d,
                });
            };
            let in_flight = r.value.busy.load(Ordering::SeqCst);
            if in_flight > 0 {
                return Err(Error::RegionBusy {
                    desc: *d,
                    in_flight,
                });
            }
        }
        Ok(descs
            .descs
            .iter()
            .filter_map(|d| map.remove_exact(descs.mem_type, d).map(|r| r.value))
            .collect())
    }

    /// Guards for every region the local descriptors fall in (one guard per
    /// distinct region touched consecutively).
    #[cfg(test)]
    pub(crate) fn acquire_local(&self, descs: &MemoryDescs) -> Result<Few<RegionGuard>, Error> {
        self.acquire_local_keyed(descs, None)
    }

    /// Guards for every region the local descriptors fall in (one guard per
    /// distinct region touched consecutively), also collecting each
    /// descriptor's local key of transport `keys.0` into `keys.1` (`None`
    /// where that transport did not register the region) when given.
    pub(crate) fn acquire_local_keyed(
        &self,
        descs: &MemoryDescs,
        mut keys: Option<(&str, &mut Few<Option<u64>>)>,
    ) -> Result<Few<RegionGuard>, Error> {
        let mut guards: Few<RegionGuard> = Few::new();
        self.each_region(descs, |r| {
            if let Some((name, k)) = keys.as_mut() {
                k.push(r.handle(name).map(|h| h.local_key()));
            }
            if !guards.last().is_some_and(|g| Arc::ptr_eq(&g.0, r)) {
                guards.push(RegionGuard::new(r));
            }
        })?;
        Ok(guards)
    }

    /// Calls `f` with the region each descriptor lies in, in order.
    ///
    /// # Errors
    /// [`Error::NotRegistered`] for the first descriptor outside every
    /// region (after `f` saw those before it).
    fn each_region(
        &self,
        descs: &MemoryDescs,
        mut f: impl FnMut(&Arc<LocalRegion>),
    ) -> Result<(), Error> {
        let map = self.read();
        let mut hint = None;
        for d in &descs.descs {
            let found = map.find_hinted(descs.mem_type, d, hint);
            hint = found;
            let Some(r) = found else {
                return Err(Error::NotRegistered {
                    mem_type: descs.mem_type,
                    desc: *d,
                });
            };
            f(&r.value);
        }
        Ok(())
    }

    /// The regions `descs` lie in, each once, and for each descriptor the
    /// index of its region among them (nothing held: a caller holds them
    /// later with [`hold_current`](Self::hold_current), from a generation
    /// read before this call).
    pub(crate) fn locate(
        &self,
        descs: &MemoryDescs,
    ) -> Result<(Vec<Arc<LocalRegion>>, Vec<u32>), Error> {
        let mut regions: Vec<Arc<LocalRegion>> = Vec::new();
        let mut index: std::collections::HashMap<usize, u32, crate::small::FastHash> =
            Default::default();
        let mut of = Vec::with_capacity(descs.descs.len());
        self.each_region(descs, |r| {
            let k = *index.entry(Arc::as_ptr(r) as usize).or_insert_with(|| {
                regions.push(Arc::clone(r));
                (regions.len() - 1) as u32
            });
            of.push(k);
        })?;
        Ok((regions, of))
    }

    /// The current generation: read it before resolving regions whose
    /// holds are to be taken again later with [`hold_current`](Self::hold_current).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Holds `regions` again, without a lookup, if no deregistration has
    /// happened since generation `seen` (the regions are then all still
    /// registered, their keys valid); `None` otherwise.
    pub(crate) fn hold_current(
        &self,
        regions: &[Arc<LocalRegion>],
        seen: u64,
    ) -> Option<Few<RegionGuard>> {
        let mut guards = Few::new();
        self.hold_into(regions, seen, &mut guards).then_some(guards)
    }

    /// [`hold_current`](Self::hold_current) into `guards` (empty on entry),
    /// where the holds are kept: true when the regions are current; false,
    /// and `guards` empty again, when a deregistration came in between.
    pub(crate) fn hold_into(
        &self,
        regions: &[Arc<LocalRegion>],
        seen: u64,
        guards: &mut Few<RegionGuard>,
    ) -> bool {
        for r in regions {
            guards.push(RegionGuard::new(r));
        }
        // After the holds: a deregistration that bumps the generation later
        // sees them and refuses; one that bumped it earlier is seen here.
        let current = self.generation.load(Ordering::SeqCst) == seen;
        if !current {
            guards.clear();
        }
        current
    }

    /// Admits a remote access to host memory `[addr, addr + len)`
    /// presenting `key`. Storage regions are never admitted here: their
    /// addresses are file offsets, reached only through
    /// [`admit_storage`](Self::admit_storage).
    pub(crate) fn admit_remote(
        &self,
        mem_type: MemoryType,
        addr: u64,
        len: u64,
        key: u64,
    ) -> Result<RegionGuard, RejectReason> {
        self.admit(
            &[MemoryType::Dram],
            mem_type,
            MemoryDesc::new(addr, len, 0),
            key,
        )
    }

    /// The VRAM regions that have an IPC handle, by access key: their
    /// allocation's handle and where they start in it.
    pub(crate) fn ipc_exports(&self) -> HashMap<u64, (GpuHandle, u64)> {
        self.read()
            .iter()
            .filter_map(|r| {
                let g = r.value.gpu.as_ref()?;
                let handle = match (&g.ipc, &g.vmm) {
                    (Some(h), _) => GpuHandle::Ipc(*h),
                    (None, Some(v)) => GpuHandle::Vmm(v.size),
                    (None, None) => return None,
                };
                Some((r.value.key, (handle, g.offset)))
            })
            .collect()
    }

    /// The VMM allocation of the VRAM region registered under `key`, when
    /// it is shareable through a descriptor.
    pub(crate) fn vmm_share(&self, key: u64) -> Option<Arc<VmmShare>> {
        self.read()
            .iter()
            .find(|r| r.value.key == key)
            .and_then(|r| r.value.gpu.as_ref()?.vmm.clone())
    }

    /// The shared pool registered under `key`, with its range.
    pub(crate) fn shared(&self, key: u64) -> Option<(MemoryDesc, Share)> {
        self.read()
            .iter()
            .find(|r| r.value.key == key)
            .and_then(|r| Some((r.desc, r.value.share.clone()?)))
    }

    /// Admits an access to host or GPU memory `[addr, addr + len)`
    /// presenting `key`, by a path that moves GPU memory (the in-process
    /// one): never storage.
    pub(crate) fn admit_memory(
        &self,
        mem_type: MemoryType,
        addr: u64,
        len: u64,
        key: u64,
    ) -> Result<RegionGuard, RejectReason> {
        let kinds = [MemoryType::Dram, MemoryType::Vram];
        self.admit(&kinds, mem_type, MemoryDesc::new(addr, len, 0), key)
    }

    /// Admits a remote access to the range `[addr, addr + len)` of storage
    /// `handle` (a FILE or BLK region), presenting `key`: the agent reads
    /// or writes it on the peer's behalf.
    pub(crate) fn admit_storage(
        &self,
        mem_type: MemoryType,
        handle: u32,
        addr: u64,
        len: u64,
        key: u64,
    ) -> Result<RegionGuard, RejectReason> {
        let kinds = [MemoryType::File, MemoryType::Blk];
        self.admit(&kinds, mem_type, MemoryDesc::new(addr, len, handle), key)
    }

    /// Admits a remote access to `[addr, addr + len)` of object `handle`
    /// (an OBJ region), presenting `key`: the agent PUTs or GETs it on the
    /// peer's behalf.
    pub(crate) fn admit_object(
        &self,
        handle: u32,
        addr: u64,
        len: u64,
        key: u64,
    ) -> Result<RegionGuard, RejectReason> {
        let kinds = [MemoryType::Obj];
        self.admit(
            &kinds,
            MemoryType::Obj,
            MemoryDesc::new(addr, len, handle),
            key,
        )
    }

    /// Admits `d` of `mem_type`, one of `kinds`, presenting `key`.
    fn admit(
        &self,
        kinds: &[MemoryType],
        mem_type: MemoryType,
        d: MemoryDesc,
        key: u64,
    ) -> Result<RegionGuard, RejectReason> {
        if !kinds.contains(&mem_type) {
            return Err(RejectReason::UnsupportedMemoryType);
        }
        let map = self.read();
        let r = map.find(mem_type, &d).ok_or(RejectReason::NotRegistered)?;
        if r.value.key != key {
            return Err(RejectReason::BadKey);
        }
        Ok(RegionGuard::new(&r.value))
    }

    /// Whether any FILE, BLK or OBJ region of storage `handle` is
    /// registered.
    pub(crate) fn has_device_regions(&self, handle: u32) -> bool {
        self.read().iter().any(|r| {
            matches!(
                r.mem_type,
                MemoryType::File | MemoryType::Blk | MemoryType::Obj
            ) && r.desc.device_id == handle
        })
    }

    /// Whether every one of `descs` lies inside a registered region.
    pub(crate) fn contains_all(&self, descs: &MemoryDescs) -> bool {
        let map = self.read();
        descs
            .descs
            .iter()
            .all(|d| map.find(descs.mem_type, d).is_some())
    }

    /// The regions to export in the agent descriptor: host and GPU memory,
    /// and storage (FILE, BLK and OBJ) regions with their direct-I/O
    /// alignment (`align` of a storage handle; peers reach those through
    /// the agent), each with its transports' keys (`offered`: the names of
    /// the transports the descriptor offers, in its order).
    pub(crate) fn exported(
        &self,
        offered: &[&str],
        align: impl Fn(u32) -> u32,
    ) -> Vec<ExportedRegion> {
        self.read()
            .iter()
            .map(|r| ExportedRegion {
                mem_type: r.mem_type,
                desc: r.desc,
                key: r.value.key,
                keys: r
                    .value
                    .handles
                    .iter()
                    .filter_map(|(name, h)| {
                        let i = offered.iter().position(|o| o == name)?;
                        Some(RegionKey {
                            transport: u8::try_from(i).ok()?,
                            key: h.remote_key(r.value.key),
                        })
                    })
                    .collect(),
                align: if r.mem_type.is_virtual_address() {
                    1
                } else {
                    align(r.desc.device_id)
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(r: &Registry, d: &MemoryDescs, t: &[MemoryType], b: &'static str) -> Result<(), Error> {
        // SAFETY: no device: nothing accesses the (fake) ranges.
        unsafe { r.register(d, t, b, &[], &[], None) }
    }

    fn dram(descs: &[(u64, u64)]) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            descs
                .iter()
                .map(|&(a, l)| MemoryDesc::new(a, l, 0))
                .collect(),
        )
    }

    /// A registrar that counts the handles alive, numbers them, and
    /// refuses the range starting at `refuse`.
    struct Counting {
        alive: Arc<AtomicUsize>,
        next: AtomicU64,
        refuse: u64,
    }

    #[derive(Debug)]
    struct Handle(u64, Arc<AtomicUsize>);

    impl Drop for Handle {
        fn drop(&mut self) {
            self.1.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl RegionHandle for Handle {
        fn local_key(&self) -> u64 {
            self.0
        }

        fn remote_key(&self, access: u64) -> Vec<u8> {
            // Wider than 32 bits, as libfabric keys may be; sealed with the
            // region's access key, as the libfabric transport's are.
            ((self.0 << 40) ^ access).to_le_bytes().to_vec()
        }
    }

    impl Registrar for Counting {
        fn name(&self) -> &'static str {
            "fake"
        }

        unsafe fn register(
            &self,
            mem_type: MemoryType,
            desc: &MemoryDesc,
            _gpu: Option<&GpuRegion>,
        ) -> Result<Option<Box<dyn RegionHandle>>, Error> {
            if mem_type != MemoryType::Dram {
                return Ok(None);
            }
            if desc.addr == self.refuse {
                return Err(Error::InvalidRequest("refused".into()));
            }
            self.alive.fetch_add(1, Ordering::SeqCst);
            let n = self.next.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(Some(Box::new(Handle(n, Arc::clone(&self.alive)))))
        }
    }

    /// Each registrar's handle lives exactly as long as its region, its
    /// keys reach the exported regions under the offered transport's index,
    /// and a refusal registers nothing.
    #[test]
    fn transports_register_regions_and_their_keys_are_exported() {
        let r = Registry::default();
        let fake = Counting {
            alive: Arc::new(AtomicUsize::new(0)),
            next: AtomicU64::new(0),
            refuse: 0x9000,
        };
        let types = [MemoryType::Dram, MemoryType::File];
        // SAFETY: the fake device touches no memory.
        let register = |d: &MemoryDescs| unsafe { r.register(d, &types, "t", &[&fake], &[], None) };
        register(&dram(&[(0x1000, 100), (0x2000, 100)])).unwrap();
        assert_eq!(fake.alive.load(Ordering::SeqCst), 2);
        // One refused: the handle made before it is dropped, nothing added.
        assert!(register(&dram(&[(0x5000, 10), (0x9000, 10)])).is_err());
        assert_eq!(fake.alive.load(Ordering::SeqCst), 2);
        assert!(!r.contains_all(&dram(&[(0x5000, 10)])));
        // Memory the transport leaves alone has no handle and no key.
        let file = MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(0, 4096, 3)]);
        register(&file).unwrap();
        assert_eq!(fake.alive.load(Ordering::SeqCst), 2);
        // Local keys by transport name.
        let mut keys = Few::new();
        let d = dram(&[(0x1000, 8), (0x2010, 8)]);
        let g = r
            .acquire_local_keyed(&d, Some(("fake", &mut keys)))
            .unwrap();
        assert_eq!(keys.as_slice(), [Some(1), Some(2)]);
        let mut none = Few::new();
        let _ = r
            .acquire_local_keyed(&d, Some(("other", &mut none)))
            .unwrap();
        assert_eq!(none.as_slice(), [None, None]);
        drop(g);
        // Exported under the offered index; not at all when not offered.
        let exp = r.exported(&["rdma", "fake"], |_| 4096);
        let of = |a: u64| exp.iter().find(|e| e.desc.addr == a).unwrap().clone();
        let r2 = of(0x2000);
        assert_eq!(
            r2.keys,
            [RegionKey {
                transport: 1,
                key: ((2u64 << 40) ^ r2.key).to_le_bytes().to_vec()
            }]
        );
        assert!(of(0).keys.is_empty());
        assert!(
            r.exported(&["rdma"], |_| 1)
                .iter()
                .all(|e| e.keys.is_empty())
        );
        // Deregistration drops the handle.
        r.deregister(&dram(&[(0x1000, 100)])).unwrap();
        assert_eq!(fake.alive.load(Ordering::SeqCst), 1);
        drop(r);
        assert_eq!(fake.alive.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn register_is_all_or_nothing() {
        let r = Registry::default();
        reg(&r, &dram(&[(0x1000, 100)]), &[MemoryType::Dram], "t").unwrap();
        // Second batch: one good, one overlapping an existing region.
        assert!(
            reg(
                &r,
                &dram(&[(0x5000, 10), (0x1010, 10)]),
                &[MemoryType::Dram],
                "t"
            )
            .is_err()
        );
        // ... or overlapping each other.
        assert!(
            reg(
                &r,
                &dram(&[(0x5000, 10), (0x5005, 10)]),
                &[MemoryType::Dram],
                "t"
            )
            .is_err()
        );
        assert_eq!(r.exported(&[], |_| 1).len(), 1);
        assert!(matches!(
            reg(
                &r,
                &MemoryDescs::new(MemoryType::Vram, vec![MemoryDesc::new(1, 1, 0)]),
                &[MemoryType::Dram],
                "t"
            ),
            Err(Error::UnsupportedMemoryType { .. })
        ));
    }

    /// Holds taken again on cached regions: granted while no
    /// deregistration happened since the generation read, refused after
    /// one (even of another region); a granted hold blocks deregistration.
    #[test]
    fn cached_holds_follow_the_generation() {
        let r = Registry::default();
        let (a, b) = (dram(&[(0x1000, 100)]), dram(&[(0x9000, 100)]));
        reg(&r, &a, &[MemoryType::Dram], "t").unwrap();
        reg(&r, &b, &[MemoryType::Dram], "t").unwrap();
        let seen = r.generation();
        let regions: Vec<_> = r
            .acquire_local(&a)
            .unwrap()
            .iter()
            .map(|g| Arc::clone(g.region()))
            .collect();
        let held = r.hold_current(&regions, seen).expect("nothing changed");
        assert!(matches!(r.deregister(&a), Err(Error::RegionBusy { .. })));
        drop(held);
        // That refused deregistration bumped the generation too.
        assert!(r.hold_current(&regions, seen).is_none());
        let seen = r.generation();
        r.deregister(&b).unwrap();
        assert!(r.hold_current(&regions, seen).is_none());
        // Into a list (the express lane's): kept when current, the list
        // emptied when not.
        let mut into = Few::new();
        assert!(r.hold_into(&regions, r.generation(), &mut into));
        assert_eq!(into.len(), 1);
        into.clear();
        assert!(!r.hold_into(&regions, seen, &mut into));
        assert!(into.is_empty());
        // A refused hold leaves nothing held.
        r.deregister(&a).unwrap();
    }

    #[test]
    fn busy_region_cannot_be_deregistered() {
        let r = Registry::default();
        let d = dram(&[(0x1000, 100)]);
        reg(&r, &d, &[MemoryType::Dram], "t").unwrap();
        let g = r
            .acquire_local(&dram(&[(0x1010, 10), (0x1020, 10)]))
            .unwrap();
        assert_eq!(
            g.len(),
            1,
            "consecutive descriptors in one region share a guard"
        );
        assert!(matches!(
            r.deregister(&d),
            Err(Error::RegionBusy { in_flight: 1, .. })
        ));
        drop(g);
        let key = r.exported(&[], |_| 1)[0].key;
        let g = r.admit_remote(MemoryType::Dram, 0x1000, 100, key).unwrap();
        assert!(r.deregister(&d).is_err());
        drop(g);
        assert!(matches!(
            r.deregister(&dram(&[(0x1000, 99)])),
            Err(Error::NotARegistration { .. })
        ));
        r.deregister(&d).unwrap();
        assert_eq!(
            r.admit_remote(MemoryType::Dram, 0x1000, 1, key)
                .unwrap_err(),
            RejectReason::NotRegistered
        );
    }

    #[test]
    fn remote_access_checks_key_and_bounds() {
        let r = Registry::default();
        reg(&r, &dram(&[(0x1000, 100)]), &[MemoryType::Dram], "t").unwrap();
        let key = r.exported(&[], |_| 1)[0].key;
        assert_eq!(
            r.admit_remote(MemoryType::Dram, 0x1000, 100, key ^ 1)
                .unwrap_err(),
            RejectReason::BadKey
        );
        assert_eq!(
            r.admit_remote(MemoryType::Dram, 0x1000, 101, key)
                .unwrap_err(),
            RejectReason::NotRegistered
        );
        assert!(r.admit_remote(MemoryType::Dram, 0x1063, 1, key).is_ok());
    }

    /// Storage regions are exported with their handle's alignment and
    /// admitted only as storage (by handle, offset and key), never as host
    /// memory (their addresses are file offsets), and host memory never as
    /// storage.
    #[test]
    fn storage_regions_are_admitted_only_as_storage() {
        let r = Registry::default();
        let file = MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(0, 8192, 3)]);
        reg(&r, &file, &[MemoryType::File, MemoryType::Dram], "t").unwrap();
        reg(&r, &dram(&[(0x1000, 100)]), &[MemoryType::Dram], "t").unwrap();
        let exported = r.exported(&[], |h| if h == 3 { 4096 } else { 1 });
        let f = exported
            .iter()
            .find(|e| e.mem_type == MemoryType::File)
            .unwrap();
        let m = exported
            .iter()
            .find(|e| e.mem_type == MemoryType::Dram)
            .unwrap();
        assert_eq!((f.align, m.align), (4096, 1));
        assert_eq!(
            r.admit_remote(MemoryType::File, 0, 4096, f.key)
                .unwrap_err(),
            RejectReason::UnsupportedMemoryType
        );
        assert_eq!(
            r.admit_storage(MemoryType::Dram, 0, 0x1000, 100, m.key)
                .unwrap_err(),
            RejectReason::UnsupportedMemoryType
        );
        assert!(
            r.admit_storage(MemoryType::File, 3, 4096, 4096, f.key)
                .is_ok()
        );
        // Another handle, past the end, the other storage kind, a bad key.
        assert_eq!(
            r.admit_storage(MemoryType::File, 4, 0, 4096, f.key)
                .unwrap_err(),
            RejectReason::NotRegistered
        );
        assert_eq!(
            r.admit_storage(MemoryType::File, 3, 4096, 4097, f.key)
                .unwrap_err(),
            RejectReason::NotRegistered
        );
        assert_eq!(
            r.admit_storage(MemoryType::Blk, 3, 0, 4096, f.key)
                .unwrap_err(),
            RejectReason::NotRegistered
        );
        assert_eq!(
            r.admit_storage(MemoryType::File, 3, 0, 4096, f.key ^ 1)
                .unwrap_err(),
            RejectReason::BadKey
        );
    }
}
