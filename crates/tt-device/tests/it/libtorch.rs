//! libtorch's view, on whatever this machine has (CPU in CI).

use tch::{nn, nn::Module, nn::OptimizerConfig, Kind, Tensor};

#[test]
fn a_real_training_step_runs_on_the_selected_device() {
    let device = tt_device::select().unwrap();
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root(), 4, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
    let x = Tensor::randn([64, 4], (Kind::Float, device));
    let y = x.sum_dim_intlist(1, true, Kind::Float);
    let first = net
        .forward(&x)
        .mse_loss(&y, tch::Reduction::Mean)
        .double_value(&[]);
    let mut last = first;
    for _ in 0..200 {
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        last = loss.double_value(&[]);
    }
    assert!(last < first * 0.1, "loss went from {first} to {last}");
    assert_eq!(net.ws.device(), device);
}

#[test]
fn the_report_agrees_with_select_and_libtorch() {
    let report = tt_device::report();
    assert_eq!(report.view, tt_device::View::Libtorch);
    assert_eq!(report.libtorch.as_ref().unwrap().version, "2.11.0");
    let selected = report.selected.clone().unwrap();
    assert_eq!(
        tch::Device::from(selected.device),
        tt_device::select().unwrap()
    );
    let cuda = report.backends.iter().find(|b| b.name == "cuda").unwrap();
    assert_eq!(cuda.available, tch::Cuda::is_available());
    let text = report.to_string();
    assert!(text.contains("libtorch     2.11.0"), "{text}");
    assert!(
        text.contains(&format!("selected     {}", selected.device)),
        "{text}"
    );
    let json: serde_json::Value = serde_json::to_value(&report).unwrap();
    assert_eq!(json["selected"]["device"], selected.device.to_string());
}

/// Runs this test binary again with `vars`, executing only `child_select`.
fn select_in_child(vars: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = tt_testkit::rerun("child_select");
    cmd.env("TT_DEVICE_TEST_CHILD", "1");
    for var in ["TORCHTOOLS_DEVICE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"] {
        cmd.env_remove(var);
    }
    cmd.envs(vars.iter().copied());
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success(), text)
}

#[test]
#[ignore = "a child process's entry point, run by the device-selection tests"]
fn child_select() {
    if std::env::var_os("TT_DEVICE_TEST_CHILD").is_none() {
        return; // only meaningful as the child of `environment_reaches_select`
    }
    match tt_device::select() {
        Ok(d) => println!("SELECTED {d:?}"),
        Err(e) => {
            println!("ERROR {e}");
            std::process::exit(3);
        }
    }
}

#[test]
fn environment_reaches_select_in_a_real_process() {
    let (ok, out) = select_in_child(&[("TORCHTOOLS_DEVICE", "cpu")]);
    assert!(ok && out.contains("SELECTED Cpu"), "{out}");
    let (ok, out) = select_in_child(&[("TORCHTOOLS_DEVICE", "tpu")]);
    assert!(
        !ok && out.contains("ERROR TORCHTOOLS_DEVICE=\"tpu\" is not a device"),
        "{out}"
    );
    let (ok, out) = select_in_child(&[("LOCAL_RANK", "x")]);
    assert!(!ok && out.contains("ERROR LOCAL_RANK=\"x\""), "{out}");
    if !tch::Cuda::is_available() {
        // CUDA asked on a machine without it: an error with the reason, never a silent CPU.
        let (ok, out) = select_in_child(&[("TORCHTOOLS_DEVICE", "cuda")]);
        assert!(!ok && out.contains("CUDA is not usable"), "{out}");
        let (ok, out) = select_in_child(&[]);
        assert!(ok && out.contains("SELECTED Cpu"), "{out}");
    }
}
