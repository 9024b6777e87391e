//! Fuzzes the frame decoder with every message type a node reads from the network: any bytes
//! must give a message or an error, never a panic, a hang or a huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use syncopate::net::proto::{ControlMessage, CoordRequest, DataRequest, DataResponse, Hello, ServerCommand, Welcome};
use syncopate::net::wire::{decode_frame, Limits};

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_header: 1 << 16, max_payload: 1 << 20 };
    let _ = decode_frame::<Hello>(data, &limits);
    let _ = decode_frame::<Welcome>(data, &limits);
    let _ = decode_frame::<DataRequest>(data, &limits);
    let _ = decode_frame::<DataResponse>(data, &limits);
    let _ = decode_frame::<CoordRequest>(data, &limits);
    let _ = decode_frame::<ServerCommand>(data, &limits);
    let _ = decode_frame::<ControlMessage>(data, &limits);
});
