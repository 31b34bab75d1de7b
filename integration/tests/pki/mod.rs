//! Test certificates (rcgen) shared by the integration tests.

/// A test PKI in `dir`: a CA, a server certificate for localhost and 127.0.0.1, client
/// certificates with CNs `app` and `root`, and a client certificate (CN `root`) from a rogue
/// CA. Files: `<name>.pem` and `<name>.key`.
pub fn test_pki(dir: &std::path::Path) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let write = |name: &str, cert: &rcgen::Certificate, key: &KeyPair| {
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    };
    let ca = |cn: &str| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        p.distinguished_name.push(DnType::CommonName, cn);
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let leaf = |cn: &str, sans: Vec<String>, ca: &(rcgen::Certificate, KeyPair)| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        let cert = p.signed_by(&key, &ca.0, &ca.1).unwrap();
        (cert, key)
    };
    let good = ca("Meridian test CA");
    write("ca", &good.0, &good.1);
    let server = leaf(
        "localhost",
        vec!["localhost".into(), "127.0.0.1".into()],
        &good,
    );
    write("server", &server.0, &server.1);
    for cn in ["app", "root"] {
        let c = leaf(cn, Vec::new(), &good);
        write(cn, &c.0, &c.1);
    }
    let rogue = ca("Rogue CA");
    let c = leaf("root", Vec::new(), &rogue);
    write("rogue-root", &c.0, &c.1);
}
