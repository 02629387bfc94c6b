//! Fuzzes the gateway's RESP command parser: arbitrary bytes never panic; parsing takes commands
//! one after another without ever claiming more bytes than it was given; every argument honours
//! the limits.
#![no_main]

use dpukv_gateway::resp::frame::{Limits, ParseError, parse_command};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_args: 64, max_arg: 256, max_command: 4096 };
    let mut at = 0;
    loop {
        match parse_command(&data[at..], &limits) {
            Ok((args, used)) => {
                assert!(used > 0 && used <= data.len() - at, "a command takes some of what is there");
                assert!(args.len() <= limits.max_args);
                assert!(args.iter().all(|a| a.len() <= limits.max_arg));
                at += used;
            }
            Err(ParseError::Incomplete) | Err(ParseError::Invalid(_)) | Err(ParseError::TooLarge(_)) => break,
        }
        if at == data.len() {
            break;
        }
    }
});
