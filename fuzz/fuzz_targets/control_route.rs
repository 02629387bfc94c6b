//! Fuzzes the control API's route parser (`dpukv_proto::control`): any method and path (the
//! first byte splits the input) never panic; a route that parses prints back to a method and a
//! path that parse to the same route; nothing longer than the limit is taken.
#![no_main]

use dpukv_proto::control::{ControlRoute, MAX_PATH};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let at = usize::from(split).min(rest.len());
    let (method, path) = rest.split_at(at);
    let (Ok(method), Ok(path)) = (std::str::from_utf8(method), std::str::from_utf8(path)) else { return };
    if let Ok(route) = ControlRoute::parse(method, path) {
        assert!(path.len() <= MAX_PATH);
        assert_eq!(route.method(), method);
        assert_eq!(ControlRoute::parse(route.method(), &route.path()), Ok(route));
    }
});
