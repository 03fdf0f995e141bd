//! Which GPUs the CUDA path takes (`amp::cuda::check_capability`): the
//! refusals a user with an A100 or a build for the wrong GPU reads, checked
//! on the CPU with the capabilities named.

use amp::cuda::{check_capability, parse_capability, MIN_COMPUTE_CAPABILITY};

#[test]
fn capabilities_parse_in_every_spelling() {
    for (s, want) in [
        ("8.9", Some((8, 9))),
        ("89", Some((8, 9))),
        ("sm_90", Some((9, 0))),
        ("compute_90", Some((9, 0))),
        (" 12.0 ", Some((12, 0))),
        ("100", Some((10, 0))),
        ("9", None),
        ("ampere", None),
        ("8.x", None),
        ("", None),
    ] {
        assert_eq!(parse_capability(s), want, "{s:?}");
    }
}

#[test]
fn ada_and_hopper_run_older_gpus_and_wrong_builds_are_refused() {
    assert_eq!(MIN_COMPUTE_CAPABILITY, (8, 9));
    // Hopper with Hopper's kernels, newer GPUs, Ada with Ada's kernels
    for (cc, arch) in [
        ((9, 0), 90),
        ((10, 0), 90),
        ((12, 0), 89),
        ((8, 9), 89),
        ((9, 0), 89),
    ] {
        assert!(check_capability(cc, arch).is_ok(), "{cc:?} {arch}");
    }
    // an A100 (or older): no FP8 in hardware, whatever the build
    for cc in [(8, 0), (8, 6), (7, 5)] {
        let e = check_capability(cc, 89).unwrap_err().to_string();
        let named = format!("{}.{}", cc.0, cc.1);
        assert!(e.contains(&named) && e.contains("8.9"), "{e}");
    }
    // an Ada GPU with kernels built for Hopper: rebuild for it
    let e = check_capability((8, 9), 90).unwrap_err().to_string();
    assert!(
        e.contains("compute_90") && e.contains("CUDA_COMPUTE_CAP=89"),
        "{e}"
    );
}
