//! The conformance suite (`specula_kernels::conformance`) on CubeCL's CPU runtime, and on
//! CUDA where `SPECULA_KERNELS_CUDA` is set; precise errors for what the device refuses.

use specula_kernels::CubeBackend;
use specula_kernels::conformance::{Weights, conformance};
use specula_quant::QType;
use specula_tensor::{Backend, KvShape, WeightDesc};

#[test]
fn cubecl_cpu_runtime_conforms() {
    conformance(&CubeBackend::cpu().unwrap());
}

#[test]
fn cuda_conforms_when_asked() {
    if std::env::var_os("SPECULA_KERNELS_CUDA").is_none() {
        eprintln!(
            "skipped: SPECULA_KERNELS_CUDA is not set (cargo xtask gpu sets it on a GPU machine)"
        );
        return;
    }
    conformance(&CubeBackend::cuda(0).expect("SPECULA_KERNELS_CUDA is set: a CUDA device"));
}

#[test]
fn unsupported_caches_and_devices_are_precise_errors() {
    let be = CubeBackend::cpu().unwrap();
    for (k, v, what) in [
        // A turbo head padded to 128 (refined on the CPU backend): not kept on the device.
        (QType::Turbo3, QType::F16, "-ctk turbo3 -ctv f16"),
        (QType::Q8_0, QType::MXFP4, "-ctk q8_0 -ctv mxfp4"),
        (QType::F32, QType::F16, "-ctk f32 -ctv f16"),
    ] {
        let Err(e) = be.kv_new(KvShape::uniform(1, 8, 1, 96, k, v)) else {
            panic!("a {what} cache was accepted")
        };
        assert!(e.to_string().contains(what), "{e}");
    }
    #[cfg(not(feature = "cuda"))]
    {
        let Err(e) = CubeBackend::cuda(0) else {
            panic!("CUDA without the feature")
        };
        assert!(e.to_string().contains("cuda"), "{e}");
    }
    // Every weight format of a model file runs on the device; Q8_K (an activation format no
    // model stores its weights in) does not, and is refused with the tensor's name.
    let w = Weights::new(QType::Q8_K, 256, 2, 1);
    let Err(e) = be.weight(WeightDesc {
        name: "blk.0.ffn_up.weight",
        ty: w.ty,
        dims: &w.dims,
        data: &w.bytes,
        owner: w.bytes.clone(),
    }) else {
        panic!("q8_K weights were accepted")
    };
    assert!(e.to_string().contains("blk.0.ffn_up.weight"), "{e}");
}
