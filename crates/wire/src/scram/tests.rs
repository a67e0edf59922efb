#[test]
fn a_cleartext_password_checks_against_the_verifier() {
    let v = Verifier::from_password("pencil");
    let key = v.check_password("pencil").expect("the right password");
    let salted = salted_password("pencil", &v.salt, v.iterations);
    assert_eq!(key, hmac(&salted, b"Client Key"));
    assert!(v.check_password("pencil ").is_none());
    assert!(v.check_password("").is_none());
}

use super::*;

/// A SCRAM-SHA-256-PLUS exchange as a client that binds to `end_point` makes it.
fn plus_exchange(verifier: &Verifier, server_has: &[u8], client_binds: &[u8]) -> bool {
    let client_nonce = "fyko+d2lbbFgONRv9qkxdawL";
    let first = format!("p=tls-server-end-point,,n=,r={client_nonce}");
    let (ex, server_first) = ServerExchange::with_binding(
        first.as_bytes(),
        verifier.clone(),
        Binding {
            plus: true,
            end_point: Some(server_has),
        },
    )
    .unwrap();
    let nonce = server_first.split(',').next().unwrap()[2..].to_string();
    let mut cbind = b"p=tls-server-end-point,,".to_vec();
    cbind.extend_from_slice(client_binds);
    let without_proof = format!("c={},r={nonce}", B64.encode(&cbind));
    let salted = salted_password("pencil", &verifier.salt, verifier.iterations);
    let client_key = hmac(&salted, b"Client Key");
    let stored: [u8; 32] = Sha256::digest(client_key).into();
    let auth = format!("n=,r={client_nonce},{server_first},{without_proof}");
    let sig = hmac(&stored, auth.as_bytes());
    let proof: Vec<u8> = client_key.iter().zip(sig).map(|(a, b)| a ^ b).collect();
    let last = format!("{without_proof},p={}", B64.encode(proof));
    ex.finish(last.as_bytes()).is_ok()
}

#[test]
fn channel_binding_to_the_servers_certificate() {
    let v = Verifier::from_password_with_salt("pencil", b"saltsaltsaltsalt".to_vec(), 16);
    assert!(plus_exchange(&v, b"cert-hash", b"cert-hash"));
    // A man in the middle terminates TLS with another certificate: the binding differs.
    assert!(!plus_exchange(&v, b"cert-hash", b"other-hash"));
    // A client that could bind but was told the server cannot: a downgrade.
    let e = ServerExchange::with_binding(
        b"y,,n=,r=abc",
        v.clone(),
        Binding {
            plus: false,
            end_point: Some(b"h"),
        },
    );
    assert!(e.is_err());
    // Without TLS, `y` is fine.
    assert!(ServerExchange::new(b"y,,n=,r=abc", v).is_ok());
}

#[test]
fn passthrough_logs_in_with_the_recovered_client_key() {
    let v = Verifier::from_password_with_salt("pencil", b"saltsaltsaltsalt".to_vec(), 16);
    // A client logs in to Shoal; Shoal recovers its ClientKey.
    let (client, first) = ClientExchange::new();
    let (server, server_first) = ServerExchange::new(first.as_bytes(), v.clone()).unwrap();
    let fin = client
        .respond(server_first.as_bytes(), |salt, i| {
            salted_password("pencil", salt, i)
        })
        .unwrap();
    let key = server.finish(fin.message.as_bytes()).unwrap().client_key;
    // Shoal logs in upstream (a server holding the same verifier) without the password.
    let (up, first) = ClientExchange::new();
    let (upstream, server_first) = ServerExchange::new(first.as_bytes(), v.clone()).unwrap();
    let fin = up
        .respond_with_key(server_first.as_bytes(), &key, &v)
        .unwrap();
    let done = upstream.finish(fin.message.as_bytes()).unwrap();
    verify_server_final(done.server_final.as_bytes(), &fin.server_signature).unwrap();
    // A server whose verifier changed (another salt) is recognised.
    let other = Verifier::from_password_with_salt("pencil", b"othersaltothersa".to_vec(), 16);
    let (up, first) = ClientExchange::new();
    let (_, server_first) = ServerExchange::new(first.as_bytes(), other).unwrap();
    assert_eq!(
        up.respond_with_key(server_first.as_bytes(), &key, &v).err(),
        Some(ScramError::VerifierChanged)
    );
}

#[test]
fn passwords_are_saslprep_normalised() {
    let salt = b"0123456789abcdef";
    // RFC 4013's examples: a soft hyphen maps to nothing, a roman numeral to letters.
    for (raw, prepared) in [("I\u{00AD}X", "IX"), ("\u{2168}", "IX"), ("\u{00AA}", "a")] {
        assert_eq!(
            salted_password(raw, salt, 16),
            salted_password(prepared, salt, 16),
            "{raw:?}"
        );
    }
    // Refused by SASLprep (a control character): used as it is.
    assert_ne!(
        salted_password("a\u{0007}", salt, 16),
        salted_password("a", salt, 16)
    );
}

// RFC 7677 section 3.
const CLIENT_FIRST: &str = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
const SERVER_NONCE: &str = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
const CLIENT_FINAL: &str = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";

fn rfc_verifier() -> Verifier {
    let salt = B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
    Verifier::from_password_with_salt("pencil", salt, 4096)
}

#[test]
fn rfc7677_vector() {
    let (ex, server_first) =
        ServerExchange::with_nonce(CLIENT_FIRST.as_bytes(), rfc_verifier(), SERVER_NONCE).unwrap();
    assert_eq!(
        server_first,
        "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    );
    let done = ex.finish(CLIENT_FINAL.as_bytes()).unwrap();
    assert_eq!(
        done.server_final,
        "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    );
    let stored: [u8; 32] = Sha256::digest(done.client_key).into();
    assert_eq!(stored, rfc_verifier().stored_key);
}

#[test]
fn client_and_server_agree() {
    let v = Verifier::from_password("hunter2");
    let (client, first) = ClientExchange::new();
    let (server, server_first) = ServerExchange::new(first.as_bytes(), v).unwrap();
    let fin = client
        .respond(server_first.as_bytes(), |salt, i| {
            salted_password("hunter2", salt, i)
        })
        .unwrap();
    let done = server.finish(fin.message.as_bytes()).unwrap();
    verify_server_final(done.server_final.as_bytes(), &fin.server_signature).unwrap();
}

#[test]
fn wrong_password_fails() {
    let salt = B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
    let wrong = Verifier::from_password_with_salt("pencil2", salt, 4096);
    let (ex, _) = ServerExchange::with_nonce(CLIENT_FIRST.as_bytes(), wrong, SERVER_NONCE).unwrap();
    assert_eq!(
        ex.finish(CLIENT_FINAL.as_bytes()).err(),
        Some(ScramError::BadProof)
    );
}

#[test]
fn verifier_text_round_trip() {
    let v = rfc_verifier();
    assert_eq!(Verifier::parse(&v.to_text()).unwrap(), v);
    assert!(Verifier::parse("SCRAM-SHA-256$x:abc$a:b").is_err());
    assert!(Verifier::parse("md5abc").is_err());
}

#[test]
fn malformed_messages_are_errors() {
    let v = rfc_verifier;
    assert!(ServerExchange::new(b"garbage", v()).is_err());
    assert!(ServerExchange::new(b"p=tls-server-end-point,,n=,r=x", v()).is_err());
    assert!(ServerExchange::new(b"n,,n=,r=", v()).is_err());
    assert!(ServerExchange::new(&[0xff, 0xfe], v()).is_err());
    let (ex, _) = ServerExchange::new(CLIENT_FIRST.as_bytes(), v()).unwrap();
    assert!(ex.finish(b"c=biws,r=wrong,p=AAAA").is_err());
    // The right proof, but client-final's GS2 header differs from client-first's
    // ("y,," there, "n,," here): a downgrade attempt.
    let first_y = CLIENT_FIRST.replacen("n,,", "y,,", 1);
    let (ex, _) = ServerExchange::with_nonce(first_y.as_bytes(), v(), SERVER_NONCE).unwrap();
    assert_eq!(
        ex.finish(CLIENT_FINAL.as_bytes()).err(),
        Some(ScramError::Malformed("channel binding data does not match"))
    );
    // Channel binding data far longer than any certificate hash.
    let nonce = CLIENT_FINAL.split(',').nth(1).unwrap();
    let long = format!("c={},{nonce},p=AAAA", B64.encode([b'n'; 400]));
    let (ex, _) = ServerExchange::with_nonce(CLIENT_FIRST.as_bytes(), v(), SERVER_NONCE).unwrap();
    assert!(ex.finish(long.as_bytes()).is_err());
    // A proof of 33 bytes.
    let proof33 = format!("c=biws,{nonce},p={}", B64.encode([7u8; 33]));
    let (ex, _) = ServerExchange::with_nonce(CLIENT_FIRST.as_bytes(), v(), SERVER_NONCE).unwrap();
    assert_eq!(
        ex.finish(proof33.as_bytes()).err(),
        Some(ScramError::Malformed("proof is not 32 bytes of base64"))
    );
}
