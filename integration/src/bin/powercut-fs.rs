//! `powercut-fs BACKING MOUNTPOINT`: mounts the power-loss file system by hand, for trying a
//! process on it. Commands on standard input, one per line: `cut`, `torn SEED`, `partial SEED`, `stats`,
//! `quit` (or end of input). Kill the processes on the mount before a cut.

use meridian_integration::powercut::PowerCutFs;
use std::io::BufRead;
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [backing, mountpoint] = args.as_slice() else {
        anyhow::bail!(
            "usage: powercut-fs BACKING MOUNTPOINT (then: cut | torn SEED | partial SEED | stats | quit)"
        );
    };
    let fs = PowerCutFs::mount(&PathBuf::from(backing), &PathBuf::from(mountpoint))?;
    println!("mounted {mountpoint} over {backing}");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["cut"] => println!("{:?}", fs.cut()),
            ["torn", seed] => println!("{:?}", fs.cut_torn(seed.parse()?)?),
            ["partial", seed] => println!("{:?}", fs.cut_partial(seed.parse()?)?),
            ["stats"] => println!("{:?}, {} bytes pending", fs.counters(), fs.pending_bytes()),
            ["quit"] => break,
            [] => {}
            _ => println!("commands: cut | torn SEED | partial SEED | stats | quit"),
        }
    }
    Ok(())
}
