{
  description = "specula: fast, lossless LLM inference with speculative decoding";

  # A reproducible development shell: the pinned Rust toolchain (same as rust-toolchain.toml),
  # cargo-nextest, Python with the reference oracles' system deps, and an optional CUDA shell.
  # `nix develop` for CPU work; `nix develop .#cuda` adds the CUDA toolkit for the GPU kernels.
  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
    rust-overlay = {
      url = "github:oxalica/rust-overlay";
      inputs.nixpkgs.follows = "nixpkgs";
    };
    flake-utils.url = "github:numtide/flake-utils";
  };

  outputs = { self, nixpkgs, rust-overlay, flake-utils }:
    flake-utils.lib.eachDefaultSystem (system:
      let
        pkgs = import nixpkgs {
          inherit system;
          overlays = [ (import rust-overlay) ];
          config.allowUnfree = true; # the CUDA toolkit
        };
        rust = pkgs.rust-bin.fromRustupToolchainFile ./rust-toolchain.toml;
        # reference/ scripts run in their own venv (`cargo xtask golden` creates it from
        # reference/requirements.txt); the shell only provides the interpreter and pip.
        python = pkgs.python311.withPackages (ps: [ ps.pip ps.virtualenv ]);
        common = [
          rust
          pkgs.cargo-nextest
          python
          pkgs.pkg-config
          pkgs.gcc # libfuzzer-sys builds libFuzzer's C++ sources
          pkgs.git
        ];
      in
      {
        devShells.default = pkgs.mkShell {
          packages = common;
          RUST_BACKTRACE = "1";
        };

        devShells.cuda = pkgs.mkShell {
          packages = common ++ [ pkgs.cudaPackages.cudatoolkit ];
          shellHook = ''
            export CUDA_PATH=${pkgs.cudaPackages.cudatoolkit}
            export LD_LIBRARY_PATH=/run/opengl-driver/lib:$LD_LIBRARY_PATH
          '';
        };

        formatter = pkgs.nixpkgs-fmt;
      });
}
