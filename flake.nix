{
  description = "specula: fast, lossless LLM inference with speculative decoding";

  # A reproducible development shell: the pinned Rust toolchain (same as rust-toolchain.toml),
  # cargo-nextest, Python for the reference oracles, LLVM for CubeCL's CPU runtime and an optional
  # CUDA shell. `nix develop` for CPU work; `nix develop .#cuda` adds the CUDA toolkit.
  #
  # Every input is pinned to a fixed revision with its content hash, so the shell is the same
  # shell next year (no channel branch, no lock file to drift): nixpkgs of 2026-07-23,
  # rust-overlay of 2026-07-24 (Rust 1.95.0 as rust-toolchain.toml asks), flake-utils 2024-11-13
  # with nix-systems/default. Move a pin by changing rev and narHash together
  # (`nix flake prefetch github:OWNER/REPO/REV` prints the hash).
  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/e2587caef70cea85dd97d7daab492899902dbf5d?narHash=sha256-wWFrV5/Qbm%2Blyt5x20E/bSbfJiGKMo4RCxZV8cl/WZI%3D";
    rust-overlay = {
      url = "github:oxalica/rust-overlay/471286a5fadc690e2408ad854eb32325f5e74da7?narHash=sha256-ZaS89rj5u6pygXKDRfCzPMGm7isJxLsSeIAR5EaSyu8%3D";
      inputs.nixpkgs.follows = "nixpkgs";
    };
    systems.url = "github:nix-systems/default/da67096a3b9bf56a91d16901293e51ba5b49a27e?narHash=sha256-Vy1rq5AaRuLzOxct8nz4T6wlgyUR7zLU309k9mBC768%3D";
    flake-utils = {
      url = "github:numtide/flake-utils/11707dc2f618dd54ca8739b309ec4fc024de578b?narHash=sha256-l0KFg5HjrsfsO/JpG%2Br7fRrqm12kzFHyUHqHCVpMMbI%3D";
      inputs.systems.follows = "systems";
    };
  };

  outputs = { self, nixpkgs, rust-overlay, flake-utils, ... }:
    flake-utils.lib.eachDefaultSystem (system:
      let
        pkgs = import nixpkgs {
          inherit system;
          overlays = [ (import rust-overlay) ];
          config.allowUnfree = true; # the CUDA toolkit
        };
        rust = pkgs.rust-bin.fromRustupToolchainFile ./rust-toolchain.toml;
        # reference/ scripts run in their own venvs (`cargo xtask golden` creates them from
        # reference/requirements*.txt: numpy, gguf-py, torch, transformers); the shell provides
        # the interpreter (3.11, as on the CI machines), pip and virtualenv, and cmake + ninja for
        # reference/build_llama_cpp.sh.
        python = pkgs.python311.withPackages (ps: [ ps.pip ps.virtualenv ]);
        # CubeCL's CPU runtime links LLVM through llvm-config (shared/research/stack.md: the
        # offline recipe points the tracel bundler at a system LLVM 22).
        llvm = pkgs.llvmPackages_22;
        common = [
          rust
          pkgs.cargo-nextest
          python
          pkgs.cmake
          pkgs.ninja
          pkgs.pkg-config
          pkgs.gcc # libfuzzer-sys builds libFuzzer's C++ sources
          pkgs.git
          llvm.llvm
          llvm.llvm.dev
          llvm.libclang
          pkgs.zlib
          pkgs.zstd
          pkgs.libxml2
        ];
      in
      {
        devShells.default = pkgs.mkShell {
          packages = common;
          RUST_BACKTRACE = "1";
          LLVM_CONFIG = "${llvm.llvm.dev}/bin/llvm-config";
          LIBCLANG_PATH = "${llvm.libclang.lib}/lib";
        };

        devShells.cuda = pkgs.mkShell {
          packages = common ++ [ pkgs.cudaPackages.cudatoolkit pkgs.cudaPackages.cudnn ];
          RUST_BACKTRACE = "1";
          LLVM_CONFIG = "${llvm.llvm.dev}/bin/llvm-config";
          LIBCLANG_PATH = "${llvm.libclang.lib}/lib";
          shellHook = ''
            export CUDA_PATH=${pkgs.cudaPackages.cudatoolkit}
            export LD_LIBRARY_PATH=/run/opengl-driver/lib:$LD_LIBRARY_PATH
          '';
        };

        formatter = pkgs.nixpkgs-fmt;
      });
}
