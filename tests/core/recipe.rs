//! Recipes: TE's field names and defaults, JSON and TOML, and bad configs as
//! errors that name the field.

use amp::{
    AmaxComputeAlgo, CoreError as Error, CurrentScaling, DelayedScaling, Float8BlockScaling,
    Format, OverrideLinearPrecision, ScaleRule, Tiling, MAX_AMAX_HISTORY_LEN,
};

fn field_of(e: &Error) -> &str {
    match e {
        Error::Config { field, .. } => field,
        other => panic!("expected a config error, got {other}"),
    }
}

#[test]
fn defaults_are_transformer_engines_but_the_format_and_first_step() {
    let r = DelayedScaling::default();
    assert_eq!(r.margin, 0);
    assert_eq!(r.interval, 1);
    // E4M3 gradients, not TE's HYBRID (measured: BENCHMARKS.md, "loss
    // parity of every level and FP8 path")
    assert_eq!(r.fp8_format, Format::E4M3);
    assert_eq!(r.amax_history_len, 1024);
    assert_eq!(r.amax_compute_algo, AmaxComputeAlgo::Max);
    assert_eq!(
        r.override_linear_precision,
        OverrideLinearPrecision::default()
    );
    // the first cast scaled by its own amax, not TE's 1 (measured: the
    // same section)
    assert!(r.calibrate_first_step);
    assert!(
        !DelayedScaling::from_json(r#"{"calibrate_first_step": false}"#)
            .unwrap()
            .calibrate_first_step
    );
    assert_eq!(DelayedScaling::from_json("{}").unwrap(), r);
    assert_eq!(DelayedScaling::from_toml("").unwrap(), r);
    // current scaling's gradients default to E4M3, not MS-AMP's HYBRID
    // (measured: BENCHMARKS.md, "loss parity of every level and FP8 path")
    let c = CurrentScaling::default();
    assert_eq!((c.margin, c.scale_rule), (0, ScaleRule::PowerOfTwo));
    assert_eq!(c.fp8_format, Format::E4M3);
    assert_eq!(CurrentScaling::from_json("{}").unwrap(), c);
}

#[test]
fn te_style_json_and_toml_parse() {
    let json = r#"{"margin": 2, "interval": 1, "fp8_format": "E4M3", "amax_history_len": 16,
                   "amax_compute_algo": "most_recent", "override_linear_precision": [false, false, true]}"#;
    let r = DelayedScaling::from_json(json).unwrap();
    assert_eq!(r.margin, 2);
    assert_eq!(r.fp8_format, Format::E4M3);
    assert_eq!(r.amax_history_len, 16);
    assert_eq!(r.amax_compute_algo, AmaxComputeAlgo::MostRecent);
    assert!(r.override_linear_precision.wgrad && !r.override_linear_precision.fprop);
    let toml = r#"
        margin = 2
        fp8_format = "E4M3"
        amax_history_len = 16
        amax_compute_algo = "most_recent"
        [override_linear_precision]
        wgrad = true
    "#;
    assert_eq!(DelayedScaling::from_toml(toml).unwrap(), r);
    // Round trips through both formats.
    assert_eq!(DelayedScaling::from_json(&r.to_json().unwrap()).unwrap(), r);
    assert_eq!(DelayedScaling::from_toml(&r.to_toml().unwrap()).unwrap(), r);
    let c = CurrentScaling {
        margin: 1,
        scale_rule: ScaleRule::Te,
        ..Default::default()
    };
    assert_eq!(CurrentScaling::from_toml(&c.to_toml().unwrap()).unwrap(), c);
    assert_eq!(Format::Hybrid.forward(), amp::Fp8Format::E4M3);
    assert_eq!(Format::Hybrid.backward(), amp::Fp8Format::E5M2);
}

#[test]
fn bad_configs_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (r#"{"fp8_format": "E3M4"}"#, "fp8_format"),
        (r#"{"fp8_format": "E5M2"}"#, "fp8_format"),
        (r#"{"amax_history_len": 0}"#, "amax_history_len"),
        // bounded: a history of 1e9 or u64::MAX slots used to allocate
        // until the process was killed, or panic with "capacity overflow"
        (r#"{"amax_history_len": 65537}"#, "amax_history_len"),
        (r#"{"amax_history_len": 1000000000}"#, "amax_history_len"),
        (
            r#"{"amax_history_len": 18446744073709551615}"#,
            "amax_history_len",
        ),
        (r#"{"margin": -1}"#, "margin"),
        (r#"{"margin": 1000}"#, "margin"),
        (r#"{"margin": "two"}"#, "margin"),
        (r#"{"interval": 0}"#, "interval"),
        (r#"{"amax_compute_algo": "mean"}"#, "amax_compute_algo"),
        (
            r#"{"override_linear_precision": [true]}"#,
            "override_linear_precision",
        ),
        (
            r#"{"override_linear_precision": {"fprop": 1}}"#,
            "override_linear_precision.fprop",
        ),
        (
            r#"{"override_linear_precision": {"bprop": true}}"#,
            "override_linear_precision",
        ),
    ];
    for (json, field) in cases {
        let e = DelayedScaling::from_json(json).unwrap_err();
        assert_eq!(field_of(&e), *field, "{json}: {e}");
        assert!(
            e.to_string().contains(field),
            "message names the field: {e}"
        );
    }
    // An unknown field is named in the message.
    let e = DelayedScaling::from_json(r#"{"amax_histroy_len": 4}"#).unwrap_err();
    assert!(e.to_string().contains("amax_histroy_len"), "{e}");
    // TOML: wrong type, negative margin, syntax.
    for (toml, field) in [
        ("margin = -1", "margin"),
        ("amax_history_len = \"long\"", "amax_history_len"),
    ] {
        let e = DelayedScaling::from_toml(toml).unwrap_err();
        assert_eq!(field_of(&e), field, "{toml}: {e}");
    }
    let e = DelayedScaling::from_toml("margin = ").unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let e = CurrentScaling::from_json(r#"{"scale_rule": "cube"}"#).unwrap_err();
    assert_eq!(field_of(&e), "scale_rule");
}

#[test]
fn config_files_by_extension() {
    let dir = std::env::temp_dir().join(format!("amp-recipe-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("r.json");
    std::fs::write(&json, r#"{"margin": 3}"#).unwrap();
    assert_eq!(DelayedScaling::from_path(&json).unwrap().margin, 3);
    let toml = dir.join("r.toml");
    std::fs::write(&toml, "margin = 4").unwrap();
    assert_eq!(DelayedScaling::from_path(&toml).unwrap().margin, 4);
    let yaml = dir.join("r.yaml");
    std::fs::write(&yaml, "margin: 4").unwrap();
    assert!(matches!(
        DelayedScaling::from_path(&yaml).unwrap_err(),
        Error::ConfigFile { .. }
    ));
    assert!(matches!(
        DelayedScaling::from_path(dir.join("missing.json")).unwrap_err(),
        Error::ConfigFile { .. }
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn amax_history_len_is_bounded_everywhere() {
    let at_max = format!(r#"{{"amax_history_len": {MAX_AMAX_HISTORY_LEN}}}"#);
    assert_eq!(
        DelayedScaling::from_json(&at_max).unwrap().amax_history_len,
        MAX_AMAX_HISTORY_LEN
    );
    let e = DelayedScaling::from_toml("amax_history_len = 1_000_000_000").unwrap_err();
    assert_eq!(field_of(&e), "amax_history_len", "{e}");
    // the metadata refuses it too, before allocating anything
    let dev = candle_core::Device::Cpu;
    for len in [0, MAX_AMAX_HISTORY_LEN + 1, usize::MAX] {
        let e = amp::ScalingMeta::new(amp::QType::E4M3, len, &dev).unwrap_err();
        assert_eq!(field_of(&e), "amax_history_len", "{len}: {e}");
    }
    assert!(amp::ScalingMeta::new(amp::QType::E4M3, MAX_AMAX_HISTORY_LEN, &dev).is_ok());
}

#[test]
fn block_scaling_takes_te_names_and_refuses_what_hopper_cannot_run() {
    let d = Float8BlockScaling::default();
    // TE's defaults: E4M3, 1D inputs and gradients, 2D weights, powers of two
    assert_eq!(d.fp8_format, Format::E4M3);
    assert_eq!(
        (
            d.x_block_scaling_dim,
            d.w_block_scaling_dim,
            d.grad_block_scaling_dim
        ),
        (1, 2, 1)
    );
    assert!(d.power_2_scale);
    assert_eq!(d.scale_rule(), ScaleRule::PowerOfTwo);
    let t = Float8BlockScaling::from_toml(
        "fp8_format = \"HYBRID\"\nw_block_scaling_dim = 1\npower_2_scale = false",
    )
    .unwrap();
    assert_eq!(t.fp8_format, Format::Hybrid);
    assert_eq!(t.weight_tiling(), Tiling::Vec128);
    assert_eq!(t.scale_rule(), ScaleRule::Te);
    let back = Float8BlockScaling::from_json(&t.to_json().unwrap()).unwrap();
    assert_eq!(back, t);
    for (text, field) in [
        (r#"{"x_block_scaling_dim": 2}"#, "x_block_scaling_dim"),
        (r#"{"grad_block_scaling_dim": 2}"#, "grad_block_scaling_dim"),
        (r#"{"w_block_scaling_dim": 3}"#, "w_block_scaling_dim"),
        (r#"{"fp8_format": "E5M2"}"#, "fp8_format"),
        (r#"{"power_2_scale": "yes"}"#, "power_2_scale"),
        (r#"{"block_len": 64}"#, "block_len"),
    ] {
        let e = Float8BlockScaling::from_json(text).unwrap_err();
        assert_eq!(field_of(&e), field, "{text}: {e}");
    }
}

#[test]
fn rowwise_scaling_refuses_e5m2_forward_and_unknown_fields() {
    let r = amp::Float8RowwiseScaling::from_json(r#"{"fp8_format": "HYBRID"}"#).unwrap();
    assert_eq!(r.fp8_format, Format::Hybrid);
    for (text, field) in [
        (r#"{"fp8_format": "E5M2"}"#, "fp8_format"),
        (
            r#"{"scaling_granularity": "axiswise"}"#,
            "scaling_granularity",
        ),
    ] {
        let e = amp::Float8RowwiseScaling::from_json(text).unwrap_err();
        assert_eq!(field_of(&e), field, "{text}: {e}");
    }
}
