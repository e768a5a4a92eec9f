//! The constraint on SmolLM2-135M's real vocabulary (skipped with a note when the model is not
//! fetched): the masks of `root ::= ("yes" | "no")` allow exactly the tokens that start one of
//! the words, then what completes it, then only end-of-generation; control tokens are never
//! text; a speculative verify batch is masked row by row as plain decoding would be.

use std::sync::Arc;

use specula_grammar::{Grammars, Spec};
use specula_tokenizer::Tokenizer;

fn allowed(g: &Grammars, c: &mut specula_grammar::Constraint) -> Vec<u32> {
    let mut row = vec![0.0f32; g.n_vocab()];
    c.mask_row(&mut row).unwrap();
    (0..g.n_vocab())
        .filter(|&i| row[i].is_finite())
        .map(|i| u32::try_from(i).unwrap())
        .collect()
}

#[test]
fn yes_no_masks_follow_the_words_on_a_real_vocabulary() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let tok = Arc::new(Tokenizer::open(&path).unwrap());
    let g = Grammars::new(Arc::clone(&tok)).unwrap();
    let mut c = g
        .compile(&Spec::Gbnf(r#"root ::= ("yes" | "no")"#.into()))
        .unwrap();
    let first = allowed(&g, &mut c);
    let piece = |t: u32| String::from_utf8(tok.token_to_piece(t, false).to_vec()).unwrap();
    assert!(!first.is_empty());
    for &t in &first {
        let p = piece(t);
        assert!(
            !p.is_empty() && ("yes".starts_with(&p) || "no".starts_with(&p)),
            "{t} {p:?} was allowed first"
        );
    }
    let yes = tok.token_id("yes").expect("SmolLM2 has a `yes` token");
    assert!(first.contains(&yes));
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert!(!first.contains(&im_end), "a control token matched text");
    // A verify batch [anchor, "yes"]: row 0 as above, row 1 after "yes" only EOG tokens.
    let n = g.n_vocab();
    let mut rows = vec![0.0f32; 2 * n];
    c.mask_rows(&mut rows, n, &[yes]).unwrap();
    let row0: Vec<u32> = (0..n)
        .filter(|&i| rows[i].is_finite())
        .map(|i| u32::try_from(i).unwrap())
        .collect();
    assert_eq!(
        row0, first,
        "the anchor row is masked with the current state"
    );
    for i in 0..n {
        let id = u32::try_from(i).unwrap();
        assert_eq!(
            rows[n + i].is_finite(),
            tok.is_eog(id),
            "token {id} after \"yes\""
        );
    }
    // The matcher was rolled back: the first mask again, and "yes" then "no" is cut at "no".
    assert_eq!(allowed(&g, &mut c), first);
    let no = tok.token_id("no").unwrap();
    assert_eq!(c.valid_prefix(&[yes, no]), 1);
    c.accept(&[yes]).unwrap();
    assert!(c.is_stopped());
}
