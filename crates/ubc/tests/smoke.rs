use std::sync::Arc;
use ubc::{pager::MemPager, Access, Cache};

#[test]
fn smoke() {
    let cache = Cache::builder().budget(1 << 20).build().unwrap();
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(f.write_at(&data, 100).unwrap(), data.len());
    assert_eq!(f.len().unwrap(), 100 + data.len() as u64);
    let mut back = vec![0u8; data.len()];
    assert_eq!(f.read_at(&mut back, 100).unwrap(), data.len());
    if let Some(i) = (0..data.len()).find(|&i| back[i] != data[i]) { panic!("mismatch at {i} (file offset {}): got {} want {}; stats {:?}", i+100, back[i], data[i], cache.stats()); }
    let st = cache.stats();
    println!("{st}");
    assert!(st.totals.resident_bytes <= 1 << 20);
}
