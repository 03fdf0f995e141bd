//! `read_scalars`: many one-element tensors read at once (the optimizer's
//! per-tensor results), exact F32 widening, views, and named errors.

use amp::kernels::read_scalars;
use amp::CoreError as Error;
use candle_core::{DType, Device, Tensor};

#[test]
fn read_scalars_reads_in_order_and_refuses_bad_inputs() {
    let dev = Device::Cpu;
    let big = Tensor::new(&[0.25f32, f32::NAN, -3.0e38, 7.0], &dev).unwrap();
    let a = big.narrow(0, 2, 1).unwrap(); // a view at offset 2
    let b = Tensor::new(&[f64::INFINITY], &dev).unwrap();
    let c = Tensor::new(&[[1e-40f32]], &dev).unwrap(); // [1, 1], subnormal
    let n = big.narrow(0, 1, 1).unwrap();
    let v = read_scalars(&[&a, &b, &c, &n]).unwrap();
    assert_eq!(v[0], f64::from(-3.0e38f32));
    assert_eq!(v[1], f64::INFINITY);
    assert_eq!(v[2], f64::from(1e-40f32));
    assert!(v[3].is_nan());
    assert!(read_scalars(&[]).unwrap().is_empty());
    let many: Vec<Tensor> = (0..600)
        .map(|i| Tensor::new(&[i as f32], &dev).unwrap())
        .collect();
    let refs: Vec<&Tensor> = many.iter().collect();
    assert_eq!(
        read_scalars(&refs).unwrap(),
        (0..600).map(f64::from).collect::<Vec<_>>()
    );
    let e = read_scalars(&[&big]).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let h = Tensor::new(&[1u32], &dev).unwrap();
    let e = read_scalars(&[&a, &h]).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let e = read_scalars(&[&a.to_dtype(DType::BF16).unwrap()]).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
}
