//! The plan cache: a bounded in-process LRU in front of a persistent SQLite
//! store ([`crate::cache::store`]) shared by every process on the host.
//!
//! Keys are plan fingerprints ([`crate::planning::fingerprint`]), which cover the
//! manifest structure, world size, topology, cost model, algorithm and
//! planner version. Entries are stored in the [`crate::cache::codec`] form and are
//! rebuilt on the caller's manifest and validated before use; an entry that
//! fails is deleted and never returned.
//!
//! Faults never fail planning. A damaged database (or one with another
//! schema) is rebuilt empty; one that cannot be opened or written (read-only
//! directory, full disk) is bypassed. Each kind of fault is reported once
//! per cache through [`PlanCache::take_warnings`].

pub mod codec;
pub mod store;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use thiserror::Error;

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::Manifest;
use crate::planning::plan::{Algorithm, Plan, PlanSource};
use store::{Store, StoreError};

/// Default number of plans kept in memory.
pub const DEFAULT_MEMORY_ENTRIES: usize = 64;
/// Default size cap of the disk store.
pub const DEFAULT_MAX_BYTES: u64 = 512 << 20;

/// An error of an explicit cache operation (`clear`, `verify`). Planning
/// through the cache never returns one.
#[derive(Debug, Error)]
pub enum CacheError {
    #[error("this plan cache has no disk store")]
    NoDisk,
    #[error("plan cache {path}: {source}")]
    Store { path: String, source: StoreError },
    #[error("plan cache {path} failed its integrity check: {detail}")]
    Integrity { path: String, detail: String },
}

/// The user's default cache directory: `$DEEPPART_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/deeppart`, else `~/.cache/deeppart`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("DEEPPART_CACHE_DIR") {
        return Some(d);
    }
    if let Some(x) = var("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(x.join("deeppart"));
    }
    var("HOME").map(|h| h.join(".cache").join("deeppart"))
}

/// Settings of a [`PlanCache`].
#[derive(Debug, Clone)]
pub struct CacheOptions {
    /// Directory of the disk store; `None` keeps plans in memory only.
    pub directory: Option<PathBuf>,
    /// Plans kept in memory (0: no memory tier).
    pub memory_entries: usize,
    /// Size cap of the disk store, in bytes of encoded plans.
    pub max_bytes: u64,
    /// Planner version stored with, and required of, every disk entry.
    /// [`crate::planning::inputs::PLANNER_VERSION`] except in tests.
    pub planner_version: String,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            directory: default_cache_dir(),
            memory_entries: DEFAULT_MEMORY_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            planner_version: crate::planning::inputs::PLANNER_VERSION.to_string(),
        }
    }
}

/// Counters and sizes of a cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits_memory: u64,
    pub hits_disk: u64,
    pub misses: u64,
    /// Disk entries this cache evicted to stay under the size cap.
    pub evictions: u64,
    /// Plans this cache dropped from memory to stay under `memory_entries`.
    pub memory_evictions: u64,
    /// Disk entries deleted because they failed their checks.
    pub discarded: u64,
    /// Disk entries deleted because another planner version wrote them.
    pub stale: u64,
    pub memory_entries: u64,
    /// Entries and encoded bytes in the disk store (0 without one).
    pub entries: u64,
    pub bytes: u64,
    /// "ok", "none" (memory only), "unopened" or "disabled: <reason>".
    pub disk: String,
}

/// Outcome of [`PlanCache::verify`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub entries: u64,
    pub valid: u64,
    /// Entries that failed their checksum or header check, and were deleted.
    pub discarded: u64,
    /// Entries written by another planner version (left in place).
    pub other_version: u64,
}

struct MemoryLru {
    cap: usize,
    tick: u64,
    map: HashMap<String, (Arc<Plan>, u64)>,
}

impl MemoryLru {
    fn get(&mut self, fp: &str) -> Option<Arc<Plan>> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(fp).map(|(p, t)| {
            *t = tick;
            p.clone()
        })
    }

    /// Inserts; returns how many plans were dropped.
    fn insert(&mut self, fp: String, plan: Arc<Plan>) -> u64 {
        if self.cap == 0 {
            return 0;
        }
        self.tick += 1;
        self.map.insert(fp, (plan, self.tick));
        let mut dropped = 0;
        while self.map.len() > self.cap {
            let oldest = self
                .map
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => {
                    self.map.remove(&k);
                    dropped += 1;
                }
                None => break,
            }
        }
        dropped
    }
}

enum Disk {
    None,
    Unopened(PathBuf),
    Open(Store, PathBuf),
    Disabled(String),
}

/// Fingerprints remembered per manifest object (see `PlanCache::fingerprint_of`).
const FP_MEMO_ENTRIES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FpKey {
    manifest: usize,
    world_size: u32,
    ranks_per_node: u32,
    cost_bits: Vec<u8>,
    algorithm: Algorithm,
}

/// A two-tier plan cache. Thread-safe; planning itself runs outside its locks.
pub struct PlanCache {
    opts: CacheOptions,
    fp_memo: Mutex<HashMap<FpKey, (Weak<Manifest>, String)>>,
    memory: Mutex<MemoryLru>,
    disk: Mutex<Disk>,
    hits_memory: AtomicU64,
    hits_disk: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    memory_evictions: AtomicU64,
    discarded: AtomicU64,
    stale: AtomicU64,
    warned: Mutex<HashSet<&'static str>>,
    warnings: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a request is: checked inputs and their fingerprint.
struct Request {
    manifest: Arc<Manifest>,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
    fingerprint: String,
}

impl PlanCache {
    pub fn new(mut opts: CacheOptions) -> PlanCache {
        // A relative directory keeps its meaning if the process changes directory.
        opts.directory = opts.directory.map(|d| std::path::absolute(&d).unwrap_or(d));
        let disk = match &opts.directory {
            Some(d) => Disk::Unopened(d.clone()),
            None => Disk::None,
        };
        PlanCache {
            memory: Mutex::new(MemoryLru {
                cap: opts.memory_entries,
                tick: 0,
                map: HashMap::new(),
            }),
            disk: Mutex::new(disk),
            fp_memo: Mutex::new(HashMap::new()),
            opts,
            hits_memory: AtomicU64::new(0),
            hits_disk: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            memory_evictions: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            warned: Mutex::new(HashSet::new()),
            warnings: Mutex::new(Vec::new()),
        }
    }

    /// The disk state. In a child forked after the database was opened, the
    /// inherited connection is abandoned (never used nor closed: closing it
    /// could disturb the parent's locks) and a new one is opened on demand.
    fn lock_disk(&self) -> MutexGuard<'_, Disk> {
        let mut disk = lock(&self.disk);
        if let Disk::Open(s, dir) = &*disk {
            if s.pid() != std::process::id() {
                let dir = dir.clone();
                if let Disk::Open(s, _) = std::mem::replace(&mut *disk, Disk::Unopened(dir)) {
                    std::mem::forget(s);
                }
            }
        }
        disk
    }

    pub fn options(&self) -> &CacheOptions {
        &self.opts
    }

    pub fn directory(&self) -> Option<&Path> {
        self.opts.directory.as_deref()
    }

    /// Warnings raised since the last call, each kind at most once per cache.
    pub fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.warnings))
    }

    fn warn(&self, kind: &'static str, message: String) {
        if lock(&self.warned).insert(kind) {
            lock(&self.warnings).push(message);
        }
    }

    /// Runs `f` on the open store, opening it first if needed. A corrupt
    /// database (or one of another schema) is rebuilt once and `f` retried;
    /// a store that cannot be used is disabled. Returns `None` when there
    /// is no usable store, or when `f` failed (warned about).
    fn with_store<T>(
        &self,
        what: &str,
        mut f: impl FnMut(&mut Store) -> store::Result<T>,
    ) -> Option<T> {
        let mut disk = self.lock_disk();
        let mut rebuilt = false;
        loop {
            if let Disk::Unopened(dir) = &*disk {
                let dir = dir.clone();
                match Store::open(&dir) {
                    Ok(s) => *disk = Disk::Open(s, dir),
                    Err(e) if e.needs_rebuild() && !rebuilt => {
                        rebuilt = true;
                        self.rebuild(&mut disk, &dir, &e);
                        continue;
                    }
                    Err(e) => {
                        self.warn(
                            "disabled",
                            format!(
                                "plan cache at {} is unusable, planning without it: {e}",
                                dir.display()
                            ),
                        );
                        *disk = Disk::Disabled(e.to_string());
                    }
                }
            }
            let Disk::Open(s, dir) = &mut *disk else {
                return None;
            };
            match f(s) {
                Ok(v) => return Some(v),
                Err(e) if e.needs_rebuild() && !rebuilt => {
                    rebuilt = true;
                    let dir = dir.clone();
                    self.rebuild(&mut disk, &dir, &e);
                }
                Err(StoreError::Busy(m)) => {
                    self.warn(
                        "busy",
                        format!("plan cache {what} skipped: database busy ({m})"),
                    );
                    return None;
                }
                Err(e) => {
                    self.warn(
                        "io",
                        format!(
                            "plan cache {what} failed at {}, continuing without it: {e}",
                            dir.display()
                        ),
                    );
                    return None;
                }
            }
        }
    }

    fn rebuild(&self, disk: &mut Disk, dir: &Path, cause: &StoreError) {
        *disk = Disk::Unopened(dir.to_path_buf()); // closes the connection
        match store::remove_files(dir) {
            Ok(()) => self.warn(
                "rebuilt",
                format!(
                    "plan cache at {} was unreadable ({cause}); rebuilt it empty",
                    dir.display()
                ),
            ),
            Err(e) => {
                self.warn(
                    "disabled",
                    format!(
                        "plan cache at {} is unreadable ({cause}) and cannot be removed ({e}); planning without it",
                        dir.display()
                    ),
                );
                *disk = Disk::Disabled(format!("{cause}; removal failed: {e}"));
            }
        }
    }

    fn request(
        &self,
        manifest: Arc<Manifest>,
        world_size: u64,
        topology: Topology,
        cost: CostModel,
        algorithm: Algorithm,
    ) -> Result<Request, PlanError> {
        let world_size =
            crate::planning::inputs::validate_inputs(&manifest, world_size, &topology, &cost)?;
        let fingerprint = self.fingerprint_of(&manifest, world_size, &topology, &cost, algorithm);
        Ok(Request {
            manifest,
            world_size,
            topology,
            cost,
            algorithm,
            fingerprint,
        })
    }

    /// The plan fingerprint, remembered per manifest allocation: asking
    /// again with the same (immutable) manifest object skips hashing it,
    /// which is most of a memory hit's cost. The memo holds a `Weak`, so the
    /// address cannot be reused by another manifest while it is remembered.
    fn fingerprint_of(
        &self,
        manifest: &Arc<Manifest>,
        world_size: u32,
        topology: &Topology,
        cost: &CostModel,
        algorithm: Algorithm,
    ) -> String {
        let mut cost_bits = Vec::with_capacity(40);
        cost.encode_canonical(&mut cost_bits);
        let key = FpKey {
            manifest: Arc::as_ptr(manifest) as usize,
            world_size,
            ranks_per_node: topology.ranks_per_node,
            cost_bits,
            algorithm,
        };
        if let Some((weak, fp)) = lock(&self.fp_memo).get(&key) {
            if weak.upgrade().is_some_and(|m| Arc::ptr_eq(&m, manifest)) {
                return fp.clone();
            }
        }
        let fp = crate::planning::fingerprint::plan_fingerprint(
            manifest, world_size, topology, cost, algorithm,
        );
        let mut memo = lock(&self.fp_memo);
        if memo.len() >= FP_MEMO_ENTRIES {
            memo.retain(|_, (weak, _)| weak.strong_count() > 0);
            if memo.len() >= FP_MEMO_ENTRIES {
                memo.clear();
            }
        }
        memo.insert(key, (Arc::downgrade(manifest), fp.clone()));
        fp
    }

    /// Computes a plan, or serves it from memory or disk. Errors only for
    /// invalid inputs, exactly like [`crate::planning::pipeline::plan`]; never because of the cache.
    pub fn plan(
        &self,
        manifest: Arc<Manifest>,
        world_size: u64,
        topology: Topology,
        cost: CostModel,
        algorithm: Algorithm,
    ) -> Result<Arc<Plan>, PlanError> {
        let started = Instant::now();
        let req = self.request(manifest, world_size, topology, cost, algorithm)?;
        if let Some(p) = self.lookup(&req, started) {
            return Ok(p);
        }
        let ranks = crate::planning::algorithms::run(
            algorithm,
            &req.manifest,
            req.world_size,
            &topology,
            &cost,
        )?;
        let plan = crate::planning::pipeline::assemble_plan_with_fingerprint(
            req.manifest,
            req.world_size,
            topology,
            cost,
            algorithm,
            ranks,
            started.elapsed().as_secs_f64() * 1e3,
            PlanSource::Computed,
            Some(req.fingerprint),
        )?;
        let plan = Arc::new(plan);
        self.put(plan.clone());
        Ok(plan)
    }

    /// Looks a plan up without computing it; counts a hit or a miss.
    pub fn get(
        &self,
        manifest: Arc<Manifest>,
        world_size: u64,
        topology: Topology,
        cost: CostModel,
        algorithm: Algorithm,
    ) -> Result<Option<Arc<Plan>>, PlanError> {
        let started = Instant::now();
        let req = self.request(manifest, world_size, topology, cost, algorithm)?;
        Ok(self.lookup(&req, started))
    }

    fn lookup(&self, req: &Request, started: Instant) -> Option<Arc<Plan>> {
        if let Some(p) = lock(&self.memory).get(&req.fingerprint) {
            self.hits_memory.fetch_add(1, Ordering::Relaxed);
            let mut plan = (*p).clone();
            plan.manifest = req.manifest.clone();
            plan.stats.source = PlanSource::Memory;
            plan.stats.plan_ms = started.elapsed().as_secs_f64() * 1e3;
            return Some(Arc::new(plan));
        }
        let entry = self
            .with_store("read", |s| s.get(&req.fingerprint))
            .flatten();
        let Some(entry) = entry else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if entry.planner_version != self.opts.planner_version {
            self.stale.fetch_add(1, Ordering::Relaxed);
            self.misses.fetch_add(1, Ordering::Relaxed);
            self.with_store("delete", |s| s.delete(&req.fingerprint));
            return None;
        }
        let decoded = codec::decode(
            &entry.data,
            req.manifest.clone(),
            req.world_size,
            req.topology,
            req.cost,
            req.algorithm,
            &req.fingerprint,
            PlanSource::Disk,
            None,
        );
        match decoded {
            Ok(mut plan) => {
                self.with_store("touch", |s| s.touch(&req.fingerprint));
                plan.stats.plan_ms = started.elapsed().as_secs_f64() * 1e3;
                let plan = Arc::new(plan);
                self.remember(plan.clone());
                self.hits_disk.fetch_add(1, Ordering::Relaxed);
                Some(plan)
            }
            Err(e) => {
                self.warn(
                    "entry",
                    format!(
                        "discarded a damaged plan cache entry {} ({e}); planning instead",
                        &req.fingerprint[..16.min(req.fingerprint.len())]
                    ),
                );
                self.discarded.fetch_add(1, Ordering::Relaxed);
                self.misses.fetch_add(1, Ordering::Relaxed);
                self.with_store("delete", |s| s.delete(&req.fingerprint));
                None
            }
        }
    }

    /// Keeps a plan in memory. Shared, not copied: a memory hit copies it
    /// out with its source set to memory.
    fn remember(&self, plan: Arc<Plan>) {
        if self.opts.memory_entries == 0 {
            return;
        }
        let dropped = lock(&self.memory).insert(plan.fingerprint.clone(), plan);
        self.memory_evictions.fetch_add(dropped, Ordering::Relaxed);
    }

    /// Stores a plan in memory and on disk. Returns whether the disk store took it.
    pub fn put(&self, plan: Arc<Plan>) -> bool {
        self.remember(plan.clone());
        if matches!(*self.lock_disk(), Disk::None | Disk::Disabled(_)) {
            return false;
        }
        let data = codec::encode(&plan);
        let out = self.with_store("write", |s| {
            s.put(
                &plan.fingerprint,
                &self.opts.planner_version,
                plan.manifest.len() as u64,
                plan.world_size,
                &data,
                self.opts.max_bytes,
            )
        });
        match out {
            Some(o) => {
                self.evictions.fetch_add(o.evicted, Ordering::Relaxed);
                o.stored
            }
            None => false,
        }
    }

    /// Counters, and the disk store's size (opening it if needed).
    pub fn stats(&self) -> CacheStats {
        let (entries, bytes) = self.with_store("stats", |s| s.totals()).unwrap_or((0, 0));
        let disk = match &*self.lock_disk() {
            Disk::None => "none".to_string(),
            Disk::Unopened(_) => "unopened".to_string(),
            Disk::Open(..) => "ok".to_string(),
            Disk::Disabled(why) => format!("disabled: {why}"),
        };
        CacheStats {
            hits_memory: self.hits_memory.load(Ordering::Relaxed),
            hits_disk: self.hits_disk.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            memory_evictions: self.memory_evictions.load(Ordering::Relaxed),
            discarded: self.discarded.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
            memory_entries: lock(&self.memory).map.len() as u64,
            entries,
            bytes,
            disk,
        }
    }

    fn dir(&self) -> Result<PathBuf, CacheError> {
        self.opts.directory.clone().ok_or(CacheError::NoDisk)
    }

    fn store_err(dir: &Path, source: StoreError) -> CacheError {
        CacheError::Store {
            path: store::db_path(dir).display().to_string(),
            source,
        }
    }

    /// Empties both tiers. A damaged database is removed and created anew;
    /// a disabled store is retried.
    pub fn clear(&self) -> Result<u64, CacheError> {
        lock(&self.memory).map.clear();
        let Some(dir) = self.opts.directory.clone() else {
            return Ok(0);
        };
        let mut disk = self.lock_disk();
        if !matches!(*disk, Disk::Open(..)) {
            *disk = Disk::Unopened(dir.clone());
        }
        if let Disk::Unopened(_) = &*disk {
            match Store::open(&dir) {
                Ok(s) => *disk = Disk::Open(s, dir.clone()),
                Err(e) if e.needs_rebuild() => {
                    store::remove_files(&dir).map_err(|io| Self::store_err(&dir, io.into()))?;
                    let s = Store::open(&dir).map_err(|e| Self::store_err(&dir, e))?;
                    *disk = Disk::Open(s, dir.clone());
                    return Ok(0);
                }
                Err(e) => return Err(Self::store_err(&dir, e)),
            }
        }
        let Disk::Open(s, _) = &*disk else {
            unreachable!()
        };
        match s.clear() {
            Ok(n) => Ok(n),
            Err(e) if e.needs_rebuild() => {
                *disk = Disk::Unopened(dir.clone());
                store::remove_files(&dir).map_err(|io| Self::store_err(&dir, io.into()))?;
                let s = Store::open(&dir).map_err(|e| Self::store_err(&dir, e))?;
                *disk = Disk::Open(s, dir.clone());
                Ok(0)
            }
            Err(e) => Err(Self::store_err(&dir, e)),
        }
    }

    /// Checks the database's structure and every entry's checksum and header;
    /// deletes entries that fail. Errors when the database itself is unreadable.
    pub fn verify(&self) -> Result<VerifyReport, CacheError> {
        let dir = self.dir()?;
        let mut disk = self.lock_disk();
        if !matches!(*disk, Disk::Open(..)) {
            let s = Store::open(&dir).map_err(|e| Self::store_err(&dir, e))?;
            *disk = Disk::Open(s, dir.clone());
        }
        let Disk::Open(s, _) = &mut *disk else {
            unreachable!()
        };
        let err = |e| Self::store_err(&dir, e);
        let check = s.integrity_check().map_err(err)?;
        if check != ["ok"] {
            return Err(CacheError::Integrity {
                path: store::db_path(&dir).display().to_string(),
                detail: check.join("; "),
            });
        }
        let mut report = VerifyReport::default();
        for info in s.list().map_err(err)? {
            let Some(entry) = s.get(&info.fingerprint).map_err(err)? else {
                continue;
            };
            report.entries += 1;
            let ok = match codec::check(&entry.data) {
                Ok((h, body)) => {
                    h.fingerprint_hex() == info.fingerprint
                        && codec::decode_pieces(&h, body).is_ok()
                }
                Err(_) => false,
            };
            if !ok {
                s.delete(&info.fingerprint).map_err(err)?;
                report.discarded += 1;
                self.discarded.fetch_add(1, Ordering::Relaxed);
            } else if entry.planner_version != self.opts.planner_version {
                report.other_version += 1;
            } else {
                report.valid += 1;
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::manifest::{Leaf, PathKey};

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "deeppart-cache-{name}-{}-{}",
            std::process::id(),
            store::now_ns()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn manifest(n: usize, scale: u64) -> Arc<Manifest> {
        let leaves = (0..n)
            .map(|i| {
                Leaf::tensor(
                    vec![PathKey::Str("p".into()), PathKey::Int(i as i64)],
                    DType::parse("float32").unwrap(),
                    vec![(i as u64 % 13 + 1) * scale, 16],
                    None,
                )
                .unwrap()
            })
            .collect();
        Arc::new(Manifest::new(leaves).unwrap())
    }

    fn opts(dir: &Path) -> CacheOptions {
        CacheOptions {
            directory: Some(dir.to_path_buf()),
            ..CacheOptions::default()
        }
    }

    fn plan_with(c: &PlanCache, m: &Arc<Manifest>, cost: CostModel) -> Arc<Plan> {
        c.plan(m.clone(), 8, Topology::default(), cost, Algorithm::Balanced)
            .unwrap()
    }

    #[test]
    fn tiers_and_sources() {
        let dir = tmpdir("tiers");
        let m = manifest(200, 50_000);
        let c = PlanCache::new(opts(&dir));
        let a = plan_with(&c, &m, CostModel::default());
        assert_eq!(a.stats.source, PlanSource::Computed);
        let b = plan_with(&c, &m, CostModel::default());
        assert_eq!(b.stats.source, PlanSource::Memory);
        assert_eq!(
            (b.ranks.clone(), b.fingerprint.clone()),
            (a.ranks.clone(), a.fingerprint.clone())
        );
        // Another cache on the same directory: a disk hit.
        let c2 = PlanCache::new(opts(&dir));
        let d = plan_with(&c2, &m, CostModel::default());
        assert_eq!(d.stats.source, PlanSource::Disk);
        assert_eq!(d.ranks, a.ranks);
        assert_eq!(d.stats.makespan_s, a.stats.makespan_s);
        // Any cost parameter is part of the key.
        let e = plan_with(
            &c2,
            &m,
            CostModel {
                writer_s: 3e-4,
                ..CostModel::default()
            },
        );
        assert_eq!(e.stats.source, PlanSource::Computed);
        let s = c2.stats();
        assert_eq!(
            (s.hits_memory, s.hits_disk, s.misses, s.entries),
            (0, 1, 1, 2)
        );
        assert!(c.take_warnings().is_empty() && c2.take_warnings().is_empty());
        assert_eq!(
            c2.verify().unwrap(),
            VerifyReport {
                entries: 2,
                valid: 2,
                ..Default::default()
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fingerprints_are_remembered_per_manifest_object_only() {
        let c = PlanCache::new(CacheOptions {
            directory: None,
            ..CacheOptions::default()
        });
        let m = manifest(30, 50_000);
        let t = Topology::default();
        let cost = CostModel::default();
        let expect = |m: &Manifest, ws: u32, cost: &CostModel| {
            crate::planning::fingerprint::plan_fingerprint(m, ws, &t, cost, Algorithm::Balanced)
        };
        for _ in 0..2 {
            assert_eq!(
                c.fingerprint_of(&m, 8, &t, &cost, Algorithm::Balanced),
                expect(&m, 8, &cost)
            );
            assert_eq!(
                c.fingerprint_of(&m, 4, &t, &cost, Algorithm::Balanced),
                expect(&m, 4, &cost)
            );
            let other = CostModel {
                bandwidth: 2e9,
                ..cost
            };
            assert_eq!(
                c.fingerprint_of(&m, 8, &t, &other, Algorithm::Balanced),
                expect(&m, 8, &other)
            );
        }
        // A different manifest, even at a reused address, is hashed afresh.
        drop(m);
        for n in 31..40 {
            let m2 = manifest(n, 50_000);
            assert_eq!(
                c.fingerprint_of(&m2, 8, &t, &cost, Algorithm::Balanced),
                expect(&m2, 8, &cost)
            );
        }
    }

    #[test]
    fn another_planner_version_misses() {
        let dir = tmpdir("version");
        let m = manifest(50, 50_000);
        let old = PlanCache::new(CacheOptions {
            planner_version: "0.0.0-old".into(),
            ..opts(&dir)
        });
        plan_with(&old, &m, CostModel::default());
        let new = PlanCache::new(opts(&dir));
        assert_eq!(
            plan_with(&new, &m, CostModel::default()).stats.source,
            PlanSource::Computed
        );
        assert_eq!(new.stats().stale, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn damaged_entries_are_discarded_and_damaged_files_rebuilt() {
        let dir = tmpdir("damage");
        let m = manifest(50, 50_000);
        let c = PlanCache::new(opts(&dir));
        let p = plan_with(&c, &m, CostModel::default());
        {
            // Flip one byte of the stored entry, keeping the row.
            let conn = rusqlite::Connection::open(store::db_path(&dir)).unwrap();
            let mut data: Vec<u8> = conn
                .query_row("SELECT data FROM plans", [], |r| r.get(0))
                .unwrap();
            let mid = data.len() / 2;
            data[mid] ^= 1;
            conn.execute("UPDATE plans SET data = ?1", [&data]).unwrap();
        }
        let c2 = PlanCache::new(opts(&dir));
        let q = plan_with(&c2, &m, CostModel::default());
        assert_eq!(q.stats.source, PlanSource::Computed);
        assert_eq!(q.ranks, p.ranks);
        let w = c2.take_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("damaged"), "{w:?}");
        assert_eq!(c2.stats().discarded, 1);
        drop(c);
        drop(c2);
        // Garbage over the whole file: rebuilt, with one warning.
        std::fs::write(store::db_path(&dir), vec![0xa5u8; 20_000]).unwrap();
        let c3 = PlanCache::new(opts(&dir));
        assert_eq!(
            plan_with(&c3, &m, CostModel::default()).stats.source,
            PlanSource::Computed
        );
        let w = c3.take_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("rebuilt"), "{w:?}");
        let c4 = PlanCache::new(opts(&dir));
        assert_eq!(
            plan_with(&c4, &m, CostModel::default()).stats.source,
            PlanSource::Disk
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unusable_directory_is_bypassed_with_one_warning() {
        let dir = tmpdir("unusable");
        let file = dir.join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let c = PlanCache::new(opts(&file.join("sub")));
        let m = manifest(20, 50_000);
        for _ in 0..3 {
            plan_with(&c, &m, CostModel::default());
        }
        assert_eq!(c.take_warnings().len(), 1);
        assert!(c.stats().disk.starts_with("disabled"));
        assert_eq!(c.stats().hits_memory, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disk_cap_evicts_least_recently_used() {
        let dir = tmpdir("cap");
        let ms: Vec<_> = (0..6).map(|i| manifest(30 + i, 50_000)).collect();
        let probe = codec::encode(&plan_with(
            &PlanCache::new(CacheOptions {
                directory: None,
                ..opts(&dir)
            }),
            &ms[0],
            CostModel::default(),
        ))
        .len() as u64;
        let c = PlanCache::new(CacheOptions {
            max_bytes: probe * 3 + probe / 2,
            memory_entries: 0,
            ..opts(&dir)
        });
        for m in &ms {
            plan_with(&c, m, CostModel::default());
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let s = c.stats();
        assert!(s.evictions >= 2, "{s:?}");
        assert!(s.bytes <= probe * 3 + probe / 2, "{s:?}");
        // The newest is still there, the oldest is gone.
        assert_eq!(
            plan_with(&c, &ms[5], CostModel::default()).stats.source,
            PlanSource::Disk
        );
        assert_eq!(
            plan_with(&c, &ms[0], CostModel::default()).stats.source,
            PlanSource::Computed
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
