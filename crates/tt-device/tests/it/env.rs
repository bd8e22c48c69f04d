//! Every form of the environment, valid and invalid; error texts are snapshots.

use tt_device::{CudaVisibleDevices, DeviceRequest, EnvConfig, VisibleEntry};

fn env(vars: &[(&str, &str)]) -> Result<EnvConfig, tt_device::Error> {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    EnvConfig::from_lookup(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
}

#[test]
fn torchtools_device_values() {
    let cases: &[(&str, Result<DeviceRequest, ()>)] = &[
        ("auto", Ok(DeviceRequest::Auto)),
        ("", Ok(DeviceRequest::Auto)),
        ("cpu", Ok(DeviceRequest::Cpu)),
        (" CPU ", Ok(DeviceRequest::Cpu)),
        ("cuda", Ok(DeviceRequest::Cuda(None))),
        ("cuda:0", Ok(DeviceRequest::Cuda(Some(0)))),
        ("CUDA:3", Ok(DeviceRequest::Cuda(Some(3)))),
        ("mps", Ok(DeviceRequest::Mps)),
        ("gpu", Err(())),
        ("gpu:1", Err(())),
        ("cuda:", Err(())),
        ("cuda:-1", Err(())),
        ("cuda:x", Err(())),
        ("cuda0", Err(())),
        ("metal", Err(())),
        ("tpu", Err(())),
    ];
    let mut errors = String::new();
    for (value, expected) in cases {
        let got = env(&[("TORCHTOOLS_DEVICE", value)]);
        match (expected, got) {
            (Ok(want), Ok(cfg)) => assert_eq!(cfg.request, *want, "TORCHTOOLS_DEVICE={value:?}"),
            (Err(()), Err(e)) => errors.push_str(&format!("{value:?} => {e}\n")),
            (want, got) => panic!("TORCHTOOLS_DEVICE={value:?}: wanted {want:?}, got {got:?}"),
        }
    }
    insta::assert_snapshot!(errors);
}

#[test]
fn local_rank_values() {
    for (value, want) in [("0", Some(0)), ("7", Some(7)), (" 2 ", Some(2)), ("", None)] {
        assert_eq!(
            env(&[("LOCAL_RANK", value)]).unwrap().local_rank,
            want,
            "LOCAL_RANK={value:?}"
        );
    }
    assert_eq!(env(&[]).unwrap().local_rank, None);
    let mut errors = String::new();
    for value in ["-1", "one", "1.0", "99999999999999999999999"] {
        let e = env(&[("LOCAL_RANK", value)]).expect_err(value);
        errors.push_str(&format!("{value:?} => {e}\n"));
    }
    insta::assert_snapshot!(errors);
}

#[test]
fn cuda_visible_devices_values() {
    use VisibleEntry::*;
    let list = |v: Vec<VisibleEntry>| CudaVisibleDevices::List(v);
    let cases = [
        ("0", list(vec![Index(0)])),
        ("0,1", list(vec![Index(0), Index(1)])),
        (" 2 , 0 ", list(vec![Index(2), Index(0)])),
        ("", list(vec![])),
        ("-1", list(vec![])),
        ("1,-1,0", list(vec![Index(1)])),
        ("GPU-8f3a", list(vec![Uuid("GPU-8f3a".into())])),
        ("MIG-1234,0", list(vec![Mig("MIG-1234".into()), Index(0)])),
    ];
    for (value, want) in cases {
        assert_eq!(
            env(&[("CUDA_VISIBLE_DEVICES", value)]).unwrap().visible,
            want,
            "{value:?}"
        );
    }
    assert_eq!(env(&[]).unwrap().visible, CudaVisibleDevices::Unset);
    let mut errors = String::new();
    for value in ["0,,1", "a", "0,gpu1", "GPU-", "4294967296"] {
        let e = env(&[("CUDA_VISIBLE_DEVICES", value)]).expect_err(value);
        errors.push_str(&format!("{value:?} => {e}\n"));
    }
    insta::assert_snapshot!(errors);
}

#[test]
fn raw_values_are_kept_for_messages() {
    let cfg = env(&[
        ("TORCHTOOLS_DEVICE", "Cuda:1"),
        ("CUDA_VISIBLE_DEVICES", "3,2"),
    ])
    .unwrap();
    assert_eq!(cfg.raw.torchtools_device.as_deref(), Some("Cuda:1"));
    assert_eq!(cfg.raw.visible_for_message(), "\"3,2\"");
    assert_eq!(env(&[]).unwrap().raw.visible_for_message(), "<unset>");
}

#[test]
fn sizes_parse_and_print() {
    use tt_device::Bytes;
    for (text, want) in [
        ("0", 0),
        ("1048576", 1 << 20),
        ("512MiB", 512 << 20),
        ("512 MiB", 512 << 20),
        ("6GiB", 6 << 30),
        ("6g", 6 << 30),
        ("1.5GiB", 3 << 29),
        ("1GB", 1_000_000_000),
        ("2kb", 2_000),
        ("20MB", 20_000_000),
    ] {
        assert_eq!(text.parse::<Bytes>().unwrap(), Bytes(want), "{text:?}");
    }
    let mut errors = String::new();
    for text in ["", "GiB", "-1GiB", "1.2.3G", "6 gigs", "99999999999TiB"] {
        let e = text.parse::<Bytes>().expect_err(text);
        errors.push_str(&format!("{text:?} => {e}\n"));
    }
    insta::assert_snapshot!(errors);
    assert_eq!(Bytes(0).to_string(), "0 B");
    assert_eq!(Bytes(1023).to_string(), "1023 B");
    assert_eq!(Bytes::mib(1).to_string(), "1.00 MiB");
    assert_eq!(Bytes::gib(80).to_string(), "80.00 GiB");
    assert_eq!(serde_json::to_string(&Bytes(5)).unwrap(), "5");
}
