//! The persistent tier of the plan cache: one SQLite database per cache
//! directory, in WAL mode, shared by every process on the host.
//!
//! Schema (version [`SCHEMA_VERSION`], also in `PRAGMA user_version` and in
//! the `meta` table; the file name carries it too, so that another schema
//! never opens this file):
//!
//! ```sql
//! meta(key TEXT PRIMARY KEY, value TEXT)          -- schema_version, created_by
//! plans(fingerprint TEXT PRIMARY KEY,             -- the plan fingerprint (hex)
//!       planner_version TEXT, codec_version INTEGER,
//!       leaves INTEGER, world_size INTEGER,
//!       size INTEGER,                             -- bytes of data
//!       created_ns INTEGER, last_used_ns INTEGER, -- unix nanoseconds
//!       data BLOB)                                -- crate::cache::codec form
//! plans_lru ON plans(last_used_ns, size)
//! ```
//!
//! Every write is one `BEGIN IMMEDIATE` transaction (insert, then evict
//! least-recently-used entries down to the size cap), so a process killed
//! at any moment leaves the last committed state; readers never block in
//! WAL mode, and writers wait for each other up to the busy timeout.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use thiserror::Error;

/// Version of the database layout.
pub const SCHEMA_VERSION: i64 = 1;
/// Name of the database file inside the cache directory.
pub const DB_FILE: &str = "plans-v1.sqlite";
/// How long a writer waits for another process's write to finish.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// What went wrong with the store, classified for the fault policy.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The file is damaged or is not a database: rebuild it.
    #[error("cache database is corrupt: {0}")]
    Corrupt(String),
    /// The file holds another layout: rebuild it.
    #[error("cache database has schema version {found}, expected {SCHEMA_VERSION}")]
    Schema { found: String },
    /// Another process holds the write lock for longer than the busy timeout.
    #[error("cache database is busy: {0}")]
    Busy(String),
    /// Cannot create, open or write (read-only directory, disk full, I/O error).
    #[error("cache database is unusable: {0}")]
    Unusable(String),
}

impl StoreError {
    pub fn needs_rebuild(&self) -> bool {
        matches!(self, StoreError::Corrupt(_) | StoreError::Schema { .. })
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        let msg = e.to_string();
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => StoreError::Corrupt(msg),
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Busy(msg),
            _ => StoreError::Unusable(msg),
        }
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Unusable(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// One stored entry, as read back.
#[derive(Debug, Clone)]
pub struct Entry {
    pub planner_version: String,
    pub data: Vec<u8>,
}

/// Summary of one entry, without its data.
#[derive(Debug, Clone)]
pub struct EntryInfo {
    pub fingerprint: String,
    pub planner_version: String,
    pub size: u64,
    pub last_used_ns: i64,
}

/// Result of a write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOutcome {
    pub stored: bool,
    pub evicted: u64,
}

/// A connection to the cache database of one directory.
pub struct Store {
    conn: Connection,
    path: PathBuf,
    pid: u32,
}

pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Path of the database file in a cache directory.
pub fn db_path(dir: &Path) -> PathBuf {
    dir.join(DB_FILE)
}

/// Removes the database and its WAL and shared-memory files. Processes that
/// still have the old file open keep their (now unlinked) copy; plans they
/// write there are lost, never mixed into the new file.
pub fn remove_files(dir: &Path) -> std::io::Result<()> {
    let db = db_path(dir);
    let mut first_err = None;
    for suffix in ["-wal", "-shm", ""] {
        let mut p = db.clone().into_os_string();
        p.push(suffix);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

const CREATE: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS plans (
    fingerprint TEXT PRIMARY KEY,
    planner_version TEXT NOT NULL,
    codec_version INTEGER NOT NULL,
    leaves INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    size INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    last_used_ns INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS plans_lru ON plans(last_used_ns, size);
";

impl Store {
    /// Opens (creating if needed) the database of `dir`, checks its schema
    /// version, and switches it to WAL mode.
    pub fn open(dir: &Path) -> Result<Store> {
        std::fs::create_dir_all(dir)?;
        let path = db_path(dir);
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&path, flags)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let store = Store {
            conn,
            path,
            pid: std::process::id(),
        };
        store.init()?;
        Ok(store)
    }

    fn init(&self) -> Result<()> {
        let c = &self.conn;
        // A file that is not a database fails here (SQLITE_NOTADB).
        let version: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version != 0 && version != SCHEMA_VERSION {
            return Err(StoreError::Schema {
                found: version.to_string(),
            });
        }
        let mode: String = c.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Unusable(format!(
                "cannot use WAL mode (journal_mode is {mode})"
            )));
        }
        c.pragma_update(None, "synchronous", "NORMAL")?;
        if version == 0 {
            c.execute_batch("BEGIN IMMEDIATE")?;
            let r = (|| -> Result<()> {
                let again: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0))?;
                if again == 0 {
                    let tables: i64 = c.query_row(
                        "SELECT count(*) FROM sqlite_master WHERE name IN ('plans', 'meta')",
                        [],
                        |r| r.get(0),
                    )?;
                    if tables != 0 {
                        return Err(StoreError::Schema {
                            found: "0 with tables present".into(),
                        });
                    }
                    c.execute_batch(CREATE)?;
                    c.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?1), ('created_by', ?2)",
                        params![SCHEMA_VERSION.to_string(), crate::planning::inputs::PLANNER_VERSION],
                    )?;
                    c.pragma_update(None, "user_version", SCHEMA_VERSION)?;
                } else if again != SCHEMA_VERSION {
                    return Err(StoreError::Schema {
                        found: again.to_string(),
                    });
                }
                Ok(())
            })();
            match r {
                Ok(()) => c.execute_batch("COMMIT")?,
                Err(e) => {
                    let _ = c.execute_batch("ROLLBACK");
                    return Err(e);
                }
            }
        }
        let meta: Option<String> = c
            .query_row(
                "SELECT value FROM meta WHERE key = 'schema_version'",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| match StoreError::from(e) {
                StoreError::Unusable(m) => StoreError::Schema {
                    found: format!("unreadable ({m})"),
                },
                other => other,
            })?;
        if meta.as_deref() != Some(&SCHEMA_VERSION.to_string()) {
            return Err(StoreError::Schema {
                found: meta.unwrap_or_else(|| "missing".into()),
            });
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The process that opened this connection. SQLite connections must not
    /// be used across `fork`: a child opens its own.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Reads one entry.
    pub fn get(&self, fingerprint: &str) -> Result<Option<Entry>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT planner_version, data FROM plans WHERE fingerprint = ?1")?;
        Ok(st
            .query_row([fingerprint], |r| {
                Ok(Entry {
                    planner_version: r.get(0)?,
                    data: r.get(1)?,
                })
            })
            .optional()?)
    }

    /// Marks an entry as just used.
    pub fn touch(&self, fingerprint: &str) -> Result<()> {
        let mut st = self
            .conn
            .prepare_cached("UPDATE plans SET last_used_ns = ?1 WHERE fingerprint = ?2")?;
        st.execute(params![now_ns(), fingerprint])?;
        Ok(())
    }

    /// Deletes one entry; returns whether it was there.
    pub fn delete(&self, fingerprint: &str) -> Result<bool> {
        let mut st = self
            .conn
            .prepare_cached("DELETE FROM plans WHERE fingerprint = ?1")?;
        Ok(st.execute([fingerprint])? > 0)
    }

    /// Stores (or replaces) an entry, then evicts least-recently-used
    /// entries until the total size is at most `max_bytes`. An entry larger
    /// than `max_bytes` is not stored. One transaction.
    pub fn put(
        &mut self,
        fingerprint: &str,
        planner_version: &str,
        leaves: u64,
        world_size: u32,
        data: &[u8],
        max_bytes: u64,
    ) -> Result<PutOutcome> {
        if data.len() as u64 > max_bytes {
            return Ok(PutOutcome::default());
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let now = now_ns();
        tx.prepare_cached(
            "INSERT INTO plans (fingerprint, planner_version, codec_version, leaves, world_size, size, created_ns, last_used_ns, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8)
             ON CONFLICT(fingerprint) DO UPDATE SET
                planner_version = excluded.planner_version, codec_version = excluded.codec_version,
                leaves = excluded.leaves, world_size = excluded.world_size, size = excluded.size,
                last_used_ns = excluded.last_used_ns, data = excluded.data",
        )?
        .execute(params![
            fingerprint,
            planner_version,
            crate::cache::codec::CODEC_VERSION,
            leaves as i64,
            world_size,
            data.len() as i64,
            now,
            data
        ])?;
        let total: i64 =
            tx.query_row("SELECT COALESCE(SUM(size), 0) FROM plans", [], |r| r.get(0))?;
        let mut evicted = 0;
        if total as u64 > max_bytes {
            let mut excess = total as u64 - max_bytes;
            let victims: Vec<(String, i64)> = {
                let mut st = tx.prepare_cached(
                    "SELECT fingerprint, size FROM plans WHERE fingerprint != ?1 ORDER BY last_used_ns, fingerprint",
                )?;
                let rows = st.query_map([fingerprint], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let mut out = Vec::new();
                for row in rows {
                    let (fp, size): (String, i64) = row?;
                    out.push((fp, size));
                    excess = excess.saturating_sub(size.max(0) as u64);
                    if excess == 0 {
                        break;
                    }
                }
                out
            };
            for (fp, _) in &victims {
                tx.prepare_cached("DELETE FROM plans WHERE fingerprint = ?1")?
                    .execute([fp])?;
                evicted += 1;
            }
        }
        tx.commit()?;
        Ok(PutOutcome {
            stored: true,
            evicted,
        })
    }

    /// Number of entries and their summed size.
    pub fn totals(&self) -> Result<(u64, u64)> {
        let (n, b): (i64, i64) = self.conn.query_row(
            "SELECT count(*), COALESCE(SUM(size), 0) FROM plans",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        Ok((n as u64, b as u64))
    }

    /// Every entry, without data, least recently used first.
    pub fn list(&self) -> Result<Vec<EntryInfo>> {
        let mut st = self.conn.prepare(
            "SELECT fingerprint, planner_version, size, last_used_ns FROM plans ORDER BY last_used_ns, fingerprint",
        )?;
        let rows = st.query_map([], |r| {
            Ok(EntryInfo {
                fingerprint: r.get(0)?,
                planner_version: r.get(1)?,
                size: r.get::<_, i64>(2)? as u64,
                last_used_ns: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }

    /// Deletes every entry and gives the space back.
    pub fn clear(&self) -> Result<u64> {
        let n = self.conn.execute("DELETE FROM plans", [])?;
        // Shrinking is best effort: another process may be reading.
        let _ = self.conn.execute_batch("VACUUM");
        let _ = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
        Ok(n as u64)
    }

    /// SQLite's own structural check; `Ok(vec!["ok"])` when sound.
    pub fn integrity_check(&self) -> Result<Vec<String>> {
        let mut st = self.conn.prepare("PRAGMA integrity_check")?;
        let rows = st.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "deeppart-store-{name}-{}-{}",
            std::process::id(),
            now_ns()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn put_get_delete_and_lru_eviction() {
        let dir = tmpdir("lru");
        let mut s = Store::open(&dir).unwrap();
        for i in 0..5 {
            let o = s
                .put(&format!("fp{i}"), "v", 1, 1, &[i as u8; 100], 350)
                .unwrap();
            assert!(o.stored);
            assert_eq!(o.evicted, if i >= 3 { 1 } else { 0 }, "put {i}");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(s.totals().unwrap(), (3, 300));
        assert!(s.get("fp0").unwrap().is_none());
        // Using fp2 makes fp3 the least recently used.
        s.touch("fp2").unwrap();
        std::thread::sleep(Duration::from_millis(2));
        s.put("fp5", "v", 1, 1, &[5; 100], 350).unwrap();
        assert!(s.get("fp3").unwrap().is_none());
        assert_eq!(s.get("fp2").unwrap().unwrap().data, vec![2u8; 100]);
        assert!(s.delete("fp2").unwrap());
        assert!(!s.delete("fp2").unwrap());
        // Larger than the cap: not stored.
        assert!(!s.put("big", "v", 1, 1, &[0; 400], 350).unwrap().stored);
        assert_eq!(s.integrity_check().unwrap(), vec!["ok".to_string()]);
        assert_eq!(s.clear().unwrap(), 2);
        assert_eq!(s.totals().unwrap(), (0, 0));
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reopen_keeps_entries_and_checks_the_schema() {
        let dir = tmpdir("schema");
        {
            let mut s = Store::open(&dir).unwrap();
            s.put("a", "v1", 1, 1, b"data", 1 << 20).unwrap();
        }
        {
            let s = Store::open(&dir).unwrap();
            let e = s.get("a").unwrap().unwrap();
            assert_eq!(
                (e.planner_version.as_str(), e.data.as_slice()),
                ("v1", &b"data"[..])
            );
            s.conn.pragma_update(None, "user_version", 99).unwrap();
        }
        let err = Store::open(&dir).err().unwrap();
        assert!(err.needs_rebuild(), "{err}");
        remove_files(&dir).unwrap();
        assert_eq!(Store::open(&dir).unwrap().totals().unwrap(), (0, 0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_is_reported_as_corrupt() {
        let dir = tmpdir("garbage");
        std::fs::write(db_path(&dir), vec![0x5au8; 8192]).unwrap();
        let err = Store::open(&dir).err().unwrap();
        assert!(err.needs_rebuild(), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
