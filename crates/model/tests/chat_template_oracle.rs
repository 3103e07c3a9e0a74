//! Chat templates rendered by minijinja against transformers' `apply_chat_template`, and the
//! tokenizer against transformers' tokenisation of the result.

use std::path::PathBuf;

use strata_model::ModelFolder;

#[test]
fn templates_and_tokens_match_transformers() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut checked = 0;
    for entry in std::fs::read_dir(root).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("reference.json").exists() {
            continue;
        }
        let folder = ModelFolder::open(&dir).unwrap();
        let template = folder.chat_template.as_ref().expect("fixtures ship a chat template");
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        for chat in reference["chats"].as_array().unwrap() {
            let mut context = serde_json::json!({
                "messages": chat["messages"],
                "tools": chat.get("tools").cloned().unwrap_or(serde_json::Value::Null),
                "add_generation_prompt": true,
            });
            for (k, v) in chat["kwargs"].as_object().unwrap() {
                context[k] = v.clone();
            }
            let text = template.render(&context).unwrap();
            assert_eq!(text, chat["text"].as_str().unwrap(), "{}", dir.display());
            let ids = folder.tokenizer.encode(&text).unwrap();
            let want: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
            assert_eq!(ids, want, "{}", dir.display());
            checked += 1;
        }
        let decoded = folder
            .tokenizer
            .decode(&folder.tokenizer.encode(reference["decoded_prompt"].as_str().unwrap()).unwrap(), false)
            .unwrap();
        assert_eq!(decoded, reference["decoded_prompt"].as_str().unwrap());
    }
    assert!(checked >= 9);
}
