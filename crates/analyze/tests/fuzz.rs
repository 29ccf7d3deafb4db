//! The parsers never panic, whatever the input.

use hybridcache_analyze::*;
use proptest::prelude::*;

fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("8,0".to_string()),
        Just("Q".to_string()),
        Just("C".to_string()),
        Just("UT".to_string()),
        Just("m".to_string()),
        Just("+".to_string()),
        Just("/".to_string()),
        Just("[x]".to_string()),
        Just("(".to_string()),
        Just("FWFS".to_string()),
        Just("read".to_string()),
        Just("Write".to_string()),
        Just("fio version 3 iolog".to_string()),
        "[0-9]{1,25}",
        "[0-9]{1,3}\\.[0-9]{0,12}",
        "[ -~]{0,8}",
    ]
}

fn line() -> impl Strategy<Value = String> {
    prop::collection::vec(token(), 0..12).prop_map(|t| t.join(" "))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        for f in [Format::Auto, Format::Blkparse, Format::Msr, Format::FioV2, Format::FioV3] {
            if let Ok(t) = parse_trace(&bytes[..], f) {
                let _ = Signature::from_trace(&t);
            }
        }
    }

    #[test]
    fn token_soup(lines in prop::collection::vec(line(), 0..40)) {
        let text = lines.join("\n");
        let csv = text.replace(' ', ",");
        for input in [&text, &csv] {
            for f in [Format::Auto, Format::Blkparse, Format::Msr, Format::FioV2, Format::FioV3] {
                if let Ok(t) = parse_trace(input.as_bytes(), f) {
                    let s = Signature::from_trace(&t);
                    let r = recommend(&s, &DeviceProfile::raid60_study());
                    let _ = Report::new(&t, &s, &r, 1).render_markdown();
                }
            }
        }
    }
}
