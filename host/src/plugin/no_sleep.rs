//! Nothing a plugin does may block the host. The only WASI 0.2 calls that
//! can wait are clock subscriptions (`wasi:clocks/monotonic-clock`
//! `subscribe-duration` / `subscribe-instant`, which Rust's `thread::sleep`,
//! Python's `time.sleep` and JS timers end in): wasmtime-wasi waits on them in
//! host code, where the epoch deadline cannot interrupt. This module shadows
//! both: a zero-length (or past) subscription is ready at once, anything
//! longer stops the plugin as "tried to sleep". Every other pollable a plugin
//! can make is ready at once in this sandbox (stdin is empty and closed,
//! stdout/stderr are memory pipes, there are no files or sockets).

use super::{Cause, PluginState};
use std::future::Future;
use std::pin::Pin;
use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime::StoreContextMut;
use wasmtime_wasi::p2::{subscribe, DynPollable, Pollable};

/// The interface as wasmtime-wasi 48 defines it (guests built against any
/// 0.2.x resolve to it).
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// A pollable that is always ready.
struct Ready;

impl Pollable for Ready {
    fn ready<'a, 'b>(&'a mut self) -> Pin<Box<dyn Future<Output = ()> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(async {})
    }
}

fn ready(table: &mut ResourceTable) -> wasmtime::Result<Resource<DynPollable>> {
    let r = table.push(Ready)?;
    subscribe(table, r)
}

fn refuse(state: &mut PluginState, ns: u64) -> wasmtime::Error {
    state.stop = Some(Cause::Sleep(ns));
    wasmtime::format_err!("plugin tried to sleep for {ns} ns")
}

/// Replace the two subscription functions of the monotonic clock.
pub(crate) fn shadow_clock_subscriptions(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap(
        "subscribe-duration",
        |mut store: StoreContextMut<'_, PluginState>, (ns,): (u64,)| {
            let state = store.data_mut();
            if ns > 0 {
                return Err(refuse(state, ns));
            }
            Ok((ready(&mut state.table)?,))
        },
    )?;
    clock.func_wrap(
        "subscribe-instant",
        |mut store: StoreContextMut<'_, PluginState>, (when,): (u64,)| {
            // The clock stands at 0: any later instant is a sleep.
            let state = store.data_mut();
            if when > 0 {
                return Err(refuse(state, when));
            }
            Ok((ready(&mut state.table)?,))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(())
}
