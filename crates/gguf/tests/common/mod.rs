//! A raw GGUF byte builder for tests: it writes whatever it is told, valid or not, so tests
//! can produce each corruption the reader must reject.

#![allow(dead_code, reason = "each test binary uses a different subset")]

pub struct RawTensor {
    pub name: Vec<u8>,
    pub dims: Vec<i64>,
    pub ty: u32,
    pub offset: u64,
}

pub struct RawFile {
    pub magic: [u8; 4],
    pub version: u32,
    pub n_tensors: Option<i64>,
    pub n_kv: Option<i64>,
    /// (key bytes, type tag, encoded value)
    pub kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    pub tensors: Vec<RawTensor>,
    pub alignment: u64,
    pub data_len: usize,
}

impl Default for RawFile {
    fn default() -> Self {
        Self {
            magic: *b"GGUF",
            version: 3,
            n_tensors: None,
            n_kv: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            data_len: 0,
        }
    }
}

pub fn str_bytes(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

impl RawFile {
    pub fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.kvs.push((key.as_bytes().to_vec(), ty, value));
        self
    }

    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.kv(key, 4, v.to_le_bytes().to_vec())
    }

    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.kv(key, 8, str_bytes(v.as_bytes()))
    }

    pub fn tensor(mut self, name: &str, dims: &[i64], ty: u32, offset: u64) -> Self {
        self.tensors.push(RawTensor {
            name: name.as_bytes().to_vec(),
            dims: dims.to_vec(),
            ty,
            offset,
        });
        self
    }

    pub fn data(mut self, len: usize) -> Self {
        self.data_len = len;
        self
    }

    /// Byte offset at which the header (before padding) ends.
    pub fn header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.magic);
        b.extend_from_slice(&self.version.to_le_bytes());
        let nt = self
            .n_tensors
            .unwrap_or(i64::try_from(self.tensors.len()).unwrap());
        let nkv = self.n_kv.unwrap_or(i64::try_from(self.kvs.len()).unwrap());
        b.extend_from_slice(&nt.to_le_bytes());
        b.extend_from_slice(&nkv.to_le_bytes());
        for (k, ty, v) in &self.kvs {
            b.extend_from_slice(&str_bytes(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(v);
        }
        for t in &self.tensors {
            b.extend_from_slice(&str_bytes(&t.name));
            b.extend_from_slice(&u32::try_from(t.dims.len()).unwrap().to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        b
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = self.header();
        let padded = usize::try_from((b.len() as u64).next_multiple_of(self.alignment)).unwrap();
        b.resize(padded + self.data_len, 0);
        b
    }
}
