//! Driver objects behind opaque handles, and the per-thread context stack.
//!
//! Objects are leaked on purpose: a handle stays dereferenceable forever and
//! destroying an object only flips its magic word, so a stale handle yields
//! an error code instead of a use-after-free. Every object starts with its
//! magic word (`repr(C)`), which is how a handle's type is checked.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::ptr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

use gpufrac_common::cuda::*;

const DEAD: u32 = 0xdead_dead;

pub trait Handle: Sized + 'static {
    const MAGIC: u32;
    fn magic(&self) -> &AtomicU32;

    fn alive(&self) -> bool {
        self.magic().load(Acquire) == Self::MAGIC
    }

    fn kill(&self) {
        self.magic().store(DEAD, Release);
    }

    fn handle(&'static self) -> *mut c_void {
        self as *const Self as *mut c_void
    }

    /// The live object behind `p`, if `p` is a handle of this type.
    ///
    /// # Safety
    /// `p` must be NULL or a handle this library handed out (of any type).
    #[inline(always)]
    unsafe fn from_handle(p: *mut c_void) -> Option<&'static Self> {
        if p.is_null() || (p as usize) & (std::mem::align_of::<Self>() - 1) != 0 {
            return None;
        }
        // SAFETY: every object starts with its AtomicU32 magic and is leaked.
        let m = unsafe { &*(p as *const AtomicU32) }.load(Acquire);
        (m == Self::MAGIC).then(|| unsafe { &*(p as *const Self) })
    }
}

pub fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

macro_rules! handle_type {
    ($t:ident, $magic:expr) => {
        impl Handle for $t {
            const MAGIC: u32 = $magic;
            fn magic(&self) -> &AtomicU32 {
                &self.magic
            }
        }
    };
}

#[repr(C)]
pub struct Ctx {
    magic: AtomicU32,
    pub flags: AtomicU32,
    pub device: usize,
    pub primary: bool,
    /// Work target (engine/model.rs) of the last kernel of any stream of this
    /// context.
    pub tail: AtomicU64,
    /// Primary contexts: retain count.
    pub refs: AtomicU32,
    /// Its entry in the device engine; 0: none yet.
    pub ent: AtomicU64,
}
handle_type!(Ctx, 0x6366_6301);

impl Ctx {
    pub fn new(device: usize, primary: bool) -> Ctx {
        Ctx {
            magic: AtomicU32::new(Self::MAGIC),
            flags: AtomicU32::new(0),
            device,
            primary,
            tail: AtomicU64::new(0),
            refs: AtomicU32::new(0),
            ent: AtomicU64::new(0),
        }
    }

    pub fn id(&'static self) -> usize {
        self as *const Ctx as usize
    }
}

#[repr(C)]
pub struct Stream {
    magic: AtomicU32,
    pub flags: u32,
    pub ctx: &'static Ctx,
    /// Work target of the last kernel on this stream.
    pub tail: AtomicU64,
    pub priority: i32,
}
handle_type!(Stream, 0x6366_7301);

impl Stream {
    pub fn new(ctx: &'static Ctx, flags: u32, priority: i32) -> Stream {
        Stream {
            magic: AtomicU32::new(Self::MAGIC),
            flags,
            ctx,
            tail: AtomicU64::new(0),
            priority,
        }
    }
}

#[repr(C)]
pub struct Event {
    magic: AtomicU32,
    pub flags: u32,
    pub ctx: &'static Ctx,
    pub rec: Mutex<EventRec>,
}
handle_type!(Event, 0x6366_6501);

/// The last record of an event.
#[derive(Clone, Copy, Default)]
pub struct EventRec {
    /// What it waits for; None: never recorded.
    pub work: Option<Work>,
    /// When it was recorded.
    pub at: u64,
    /// When it completed; 0: not known yet.
    pub done: u64,
    /// Counts records, so a late dating of an earlier one is told apart.
    pub generation: u64,
}

impl Event {
    pub fn new(ctx: &'static Ctx, flags: u32) -> Event {
        Event {
            magic: AtomicU32::new(Self::MAGIC),
            flags,
            ctx,
            rec: Mutex::new(EventRec::default()),
        }
    }

    pub fn get(&self) -> EventRec {
        *self.rec.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `work` at `at`, `done` then if nonzero; returns the record's
    /// generation.
    pub fn record(&self, work: Work, at: u64, done: u64) -> u64 {
        let mut r = self.rec.lock().unwrap_or_else(|e| e.into_inner());
        *r = EventRec {
            work: Some(work),
            at,
            done,
            generation: r.generation + 1,
        };
        r.generation
    }
}

#[repr(C)]
pub struct Pool {
    magic: AtomicU32,
    pub device: usize,
    pub is_default: bool,
}
handle_type!(Pool, 0x6366_7001);

impl Pool {
    pub fn new(device: usize, is_default: bool) -> Pool {
        Pool {
            magic: AtomicU32::new(Self::MAGIC),
            device,
            is_default,
        }
    }
}

#[repr(C)]
pub struct Module {
    magic: AtomicU32,
}
handle_type!(Module, 0x6366_6d01);

impl Module {
    pub fn new() -> Module {
        Module {
            magic: AtomicU32::new(Self::MAGIC),
        }
    }
}

#[repr(C)]
pub struct Func {
    magic: AtomicU32,
    pub module: usize,
}
handle_type!(Func, 0x6366_6601);

impl Func {
    pub fn new(module: usize) -> Func {
        Func {
            magic: AtomicU32::new(Self::MAGIC),
            module,
        }
    }
}

#[repr(C)]
pub struct GraphExec {
    magic: AtomicU32,
    pub duration_ns: u64,
}
handle_type!(GraphExec, 0x6366_6701);

impl GraphExec {
    pub fn new(duration_ns: u64) -> GraphExec {
        GraphExec {
            magic: AtomicU32::new(Self::MAGIC),
            duration_ns,
        }
    }
}

// ---------------------------------------------------------------------------
// Per-thread context stack and per-thread default streams.

thread_local! {
    /// Top of the stack, mirrored for cheap reads (no destructor: always accessible).
    static CUR: Cell<*const Ctx> = const { Cell::new(ptr::null()) };
    static STACK: RefCell<Vec<*const Ctx>> = const { RefCell::new(Vec::new()) };
    static PTDS_CACHE: Cell<(*const Ctx, *const Stream)> =
        const { Cell::new((ptr::null(), ptr::null())) };
    static PTDS: RefCell<Vec<(*const Ctx, &'static Stream)>> = const { RefCell::new(Vec::new()) };
}

/// The current context, or `CUDA_ERROR_INVALID_CONTEXT`.
#[inline(always)]
pub fn current() -> Result<&'static Ctx, CUresult> {
    let p = CUR.get();
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    // SAFETY: only leaked contexts are ever stored.
    let c = unsafe { &*p };
    if c.alive() {
        Ok(c)
    } else {
        Err(CUDA_ERROR_INVALID_CONTEXT)
    }
}

pub fn current_raw() -> *const Ctx {
    CUR.get()
}

fn with_stack<R>(f: impl FnOnce(&mut Vec<*const Ctx>) -> R) -> Result<R, CUresult> {
    STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let r = f(&mut s);
            CUR.set(s.last().copied().unwrap_or(ptr::null()));
            r
        })
        .map_err(|_| CUDA_ERROR_UNKNOWN)
}

/// `cuCtxSetCurrent` semantics: replace the top; NULL pops.
pub fn set_current(c: *const Ctx) -> Result<(), CUresult> {
    with_stack(|s| {
        if c.is_null() {
            s.pop();
        } else if let Some(top) = s.last_mut() {
            *top = c;
        } else {
            s.push(c);
        }
    })
}

pub fn push(c: *const Ctx) -> Result<(), CUresult> {
    with_stack(|s| s.push(c))
}

pub fn pop() -> Result<Option<*const Ctx>, CUresult> {
    with_stack(|s| s.pop())
}

/// Pops `c` if it is the calling thread's current context.
pub fn pop_if_current(c: *const Ctx) -> Result<(), CUresult> {
    with_stack(|s| {
        if s.last().is_some_and(|&t| ptr::eq(t, c)) {
            s.pop();
        }
    })
}

/// The calling thread's per-thread default stream of `ctx`.
#[inline]
pub fn per_thread_stream(ctx: &'static Ctx) -> &'static Stream {
    let (c, s) = PTDS_CACHE.get();
    if ptr::eq(c, ctx) {
        // SAFETY: cached from a leaked stream.
        return unsafe { &*s };
    }
    let s = PTDS
        .try_with(|v| {
            let mut v = v.borrow_mut();
            match v.iter().find(|(c, _)| ptr::eq(*c, ctx)) {
                Some(&(_, s)) => s,
                None => {
                    let s = leak(Stream::new(ctx, 0, 0));
                    v.push((ctx, s));
                    s
                }
            }
        })
        .unwrap_or_else(|_| leak(Stream::new(ctx, 0, 0)));
    PTDS_CACHE.set((ctx, s));
    s
}

pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// Where work submitted to a stream goes: its context and the tail that
/// orders it (a work target of that context).
#[derive(Clone, Copy)]
pub struct Target {
    pub ctx: &'static Ctx,
    pub tail: &'static AtomicU64,
}

/// Resolves a stream argument. NULL is the legacy stream, or for `_ptsz`
/// entry points the per-thread default stream. The legacy stream orders
/// after every stream of its context, so its tail is the context's tail.
#[inline(always)]
pub unsafe fn resolve_stream(stream: CUstream, ptsz: bool) -> Result<Target, CUresult> {
    let (ctx, per_thread) = match stream as usize {
        0 => (current()?, ptsz),
        CU_STREAM_LEGACY => (current()?, false),
        CU_STREAM_PER_THREAD => (current()?, true),
        _ => {
            // SAFETY: caller passes a handle from this library.
            let s = unsafe { Stream::from_handle(stream) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if !s.ctx.alive() {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            return Ok(Target {
                ctx: s.ctx,
                tail: &s.tail,
            });
        }
    };
    Ok(Target {
        ctx,
        tail: if per_thread {
            &per_thread_stream(ctx).tail
        } else {
            &ctx.tail
        },
    })
}

#[inline(always)]
pub(crate) fn fetch_max(a: &AtomicU64, v: u64) {
    // Skip the read-modify-write when it would change nothing (common for
    // the context tail).
    if a.load(Relaxed) < v {
        a.fetch_max(v, AcqRel);
    }
}

/// A point in one context's work: done once its executed work reaches `x`.
#[derive(Clone, Copy, Debug)]
pub struct Work {
    pub dev: usize,
    /// The context object (process-local identity).
    pub ctx: usize,
    /// Its entry binding when captured; 0: it never had work.
    pub(crate) bind: u64,
    pub(crate) x: u64,
}

impl Work {
    /// All work submitted so far to `t`'s stream.
    pub fn of(t: Target) -> Work {
        Work {
            dev: t.ctx.device,
            ctx: t.ctx.id(),
            bind: t.ctx.ent.load(Acquire),
            x: t.tail.load(Acquire),
        }
    }

    /// All work submitted so far to `c`.
    pub fn ctx(c: &'static Ctx) -> Work {
        Work {
            dev: c.device,
            ctx: c.id(),
            bind: c.ent.load(Acquire),
            x: c.tail.load(Acquire),
        }
    }

    /// Orders `t`'s later work after this point, which must be of the same
    /// context (one FIFO: raising the stream's target is all it takes).
    pub fn order_before(&self, t: Target) {
        fetch_max(t.tail, self.x);
    }
}
